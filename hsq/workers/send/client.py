"""HTTP clients for an inference server: SGLang's /generate (SGLang, the reference server)
and stock vLLM's completions API with hsq's connector (VllmClient), the same errors and the
same answer from both.

The transport (hsq/workers/send/http.py: http.client in production, any httpx transport in
tests) maps the connection's errors into hsq's: a server that cannot be reached is
unavailable (not the sample's fault); one that died after the request was sent is
unavailable *mid-request* (counted per sample, so a sample that kills the server ends in the
dead letter instead of killing it forever). 4xx/5xx answers are the sample's, here.

A request that meets a kept-alive connection the server had just closed fails with
StaleConnection: /health is then asked again here, a prefill by its caller, which gives
the new request a new rid (hsq/workers/send/extract.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from hsq import jsonsafe
from hsq.errors import ServerRejectedError, ServerUnavailableError
from hsq.workers.send.http import (
    HttpxTransport,
    MidRequestFailure,
    StaleConnection,
    StdlibTransport,
    Transport,
)

if TYPE_CHECKING:
    import httpx

__all__ = [
    "MAX_ANSWER_BYTES",
    "MidRequestFailure",
    "PrefillAnswer",
    "ServerClient",
    "StaleConnection",
    "VllmClient",
]

# A prefill answer (max_new_tokens=0) is a few hundred bytes; a body far larger is not one.
MAX_ANSWER_BYTES = 1 << 20
# The request body is encoded by msgspec: json.dumps of 300 token ids costs ~80 us of the
# worker's interpreter, msgspec ~2.5 us, and
# one interpreter is the worker's ceiling on short samples.
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class PrefillAnswer:
    prompt_tokens: int
    cached_tokens: int
    raw: dict[str, Any]


class ServerClient:
    def __init__(
        self,
        base_url: str,
        *,
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`transport`: an httpx transport instead of the network (tests)."""
        self.base_url = base_url.rstrip("/")
        self._http: Transport
        if transport is None:
            self._http = StdlibTransport(
                self.base_url, request_timeout=request_timeout, connect_timeout=connect_timeout
            )
        else:
            self._http = HttpxTransport(
                self.base_url,
                transport,
                request_timeout=request_timeout,
                connect_timeout=connect_timeout,
            )

    def close(self) -> None:
        self._http.close()

    def prefill(self, input_ids: list[int], rid: str, *, fresh: bool = False) -> PrefillAnswer:
        """One prefill with ``rid``; ``fresh``: on a new connection (after StaleConnection)."""
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}, "rid": rid}
        answer = self._post_json("/generate", body, fresh=fresh)
        try:
            info = answer["meta_info"]
            return PrefillAnswer(
                int(info["prompt_tokens"]), int(info.get("cached_tokens", 0)), answer
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerRejectedError(f"unexpected answer from /generate: {exc!r}", 502) from exc

    def _post_json(self, path: str, body: dict[str, Any], *, fresh: bool = False) -> Any:
        """POST ``body``; the parsed answer, or hsq's error for what went wrong."""
        status, data = self._http.request(
            "POST", path, _encode(body), timeout=None, limit=MAX_ANSWER_BYTES, fresh=fresh
        )
        if status == 503:
            raise ServerUnavailableError(f"{self.base_url} is not ready (503)")
        if data is None:
            raise ServerRejectedError(
                f"{self.base_url} answered {status} with a body over {MAX_ANSWER_BYTES} bytes", 502
            )
        if status >= 400:
            text = data[:500].decode(errors="replace")
            raise ServerRejectedError(f"{self.base_url} answered {status}: {text}", status)
        try:
            return jsonsafe.loads(data)
        except ValueError as exc:
            raise ServerRejectedError(f"unexpected answer from {path}: {exc!r}", 502) from exc

    def healthy(self) -> bool:
        try:
            try:
                status, _ = self._http.request(
                    "GET", "/health", None, timeout=5.0, limit=MAX_ANSWER_BYTES
                )
            except StaleConnection:  # the idle close crossed the request: ask once more
                status, _ = self._http.request(
                    "GET", "/health", None, timeout=5.0, limit=MAX_ANSWER_BYTES, fresh=True
                )
        except ServerUnavailableError:
            return False
        return status == 200


# ---------------------------------------------------------------------------- vLLM
# One prefill is a ``/v1/completions`` request: the prompt as token ids, ``max_tokens: 1``
# (vLLM requires at least one sampled token: prefill plus one decode step, whose state is
# never dumped), and the worker's rid both as the request id and in ``kv_transfer_params``,
# where the connector reads it (vLLM's own request id gets a prefix and a random suffix, so
# the connector cannot take it from there).

RID_PARAM = "hsq_rid"
"""The key of ``kv_transfer_params`` the connector reads (hsq.engines.vllm.config.RID_PARAM;
the worker imports no other service, so the name is pinned by tests/test_vllm_client.py)."""


class VllmClient(ServerClient):
    def __init__(self, base_url: str, *, model: str | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.model = model

    def prefill(self, input_ids: list[int], rid: str, *, fresh: bool = False) -> PrefillAnswer:
        body: dict[str, Any] = {
            "prompt": input_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "request_id": rid,
            "kv_transfer_params": {RID_PARAM: rid},
        }
        if self.model is not None:
            body["model"] = self.model
        answer = self._post_json("/v1/completions", body, fresh=fresh)
        return parse_completion(answer)


def parse_completion(answer: Any) -> PrefillAnswer:
    """``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` of a
    completions answer. Without ``--enable-prompt-tokens-details`` vLLM sends no details:
    the cached count is then 0 by construction, since the connector refuses to start with
    prefix caching on."""
    try:
        usage = answer["usage"]
        prompt = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") or 0
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (prompt, cached)):
            raise TypeError(f"token counts {prompt!r}, {cached!r} are not integers")
        return PrefillAnswer(prompt, cached, answer)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ServerRejectedError(f"unexpected answer from /v1/completions: {exc!r}", 502) from exc


def make_client(
    kind: str, base_url: str, *, request_timeout: float, model: str | None = None
) -> ServerClient:
    """The client for an engine's API (EngineApi.engine): same errors, same answer."""
    if kind == "vllm":
        return VllmClient(base_url, model=model, request_timeout=request_timeout)
    if kind != "sglang":
        raise ValueError(f"unknown server kind {kind!r}")
    return ServerClient(base_url, request_timeout=request_timeout)
