"""HTTP client for an inference server (SGLang or the reference server; vLLM:
hsq/workers/vllm_client.py, the same errors over its completions API).

Translates httpx errors into hsq's: a server that cannot be reached is unavailable (not
the sample's fault); one that died after the request was sent is unavailable *mid-request*
(counted per sample, so a sample that kills the server ends in the dead letter instead of
killing it forever); 4xx/5xx answers are the sample's.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from hsq import jsonsafe
from hsq.errors import ServerRejectedError, ServerUnavailableError
from hsq.lean import PRETTY, hidden

with hidden(*PRETTY):  # for httpx's own command line, never used here
    import httpx

# A prefill answer (max_new_tokens=0) is a few hundred bytes; a body far larger is not one.
MAX_ANSWER_BYTES = 1 << 20
_JSON = {"content-type": "application/json"}
# The request body is encoded by msgspec: json.dumps of 300 token ids costs ~80 us of the
# worker's interpreter, msgspec ~2.5 us (issue 35).
_encode = msgspec.json.Encoder().encode


class MidRequestFailure(ServerUnavailableError):
    """The connection broke or timed out after the request was sent: the server probably
    crashed on the sample. Counted per sample; the dead letter records ``reason``."""

    reason = "server_crash"


@dataclass(frozen=True)
class PrefillAnswer:
    prompt_tokens: int
    cached_tokens: int
    raw: dict[str, Any]


def tls_verify(url: str) -> ssl.SSLContext | bool:
    """httpx's `verify` for a server at `url`. https://: the default trust store. http://:
    a client TLS context that trusts nothing (every check on, no CA loaded), as no TLS is
    spoken there: loading the CA bundle cost 30-50 ms of CPU at every worker start, and a
    redirect to https (not followed anyway) would fail its verification, never pass
    unchecked."""
    if urlsplit(url).scheme.lower() == "https":
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class ServerClient:
    def __init__(
        self,
        base_url: str,
        *,
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
            transport=transport,
            verify=tls_verify(self.base_url),
        )

    def close(self) -> None:
        self._http.close()

    def prefill(self, input_ids: list[int], rid: str) -> PrefillAnswer:
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}, "rid": rid}
        answer = self._post_json("/generate", body)
        try:
            info = answer["meta_info"]
            return PrefillAnswer(
                int(info["prompt_tokens"]), int(info.get("cached_tokens", 0)), answer
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerRejectedError(f"unexpected answer from /generate: {exc!r}", 502) from exc

    def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body``; the parsed answer, or hsq's error for what went wrong."""
        try:
            with self._http.stream("POST", path, content=_encode(body), headers=_JSON) as r:
                status = r.status_code
                data = _read_limited(r, MAX_ANSWER_BYTES)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise ServerUnavailableError(f"{self.base_url} unreachable: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise MidRequestFailure(f"{self.base_url} failed mid-request: {exc!r}") from exc
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
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self) -> dict[str, Any]:
        try:
            r = self._http.get("/model_info", timeout=10.0)
            r.raise_for_status()
            data: dict[str, Any] = r.json()
            return data
        except httpx.HTTPError as exc:
            raise ServerUnavailableError(f"{self.base_url}/model_info: {exc!r}") from exc


def _read_limited(r: httpx.Response, limit: int) -> bytes | None:
    """The body, or None if it is longer than ``limit`` (read no further than that)."""
    declared = r.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    buf = bytearray()
    for chunk in r.iter_bytes():
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


def make_client(
    kind: str, base_url: str, *, request_timeout: float, model: str | None = None
) -> ServerClient:
    """The client for a server kind (WorkerSettings.server_kind): same errors, same answer."""
    if kind == "vllm":
        from hsq.workers.vllm_client import VllmClient

        return VllmClient(base_url, model=model, request_timeout=request_timeout)
    if kind != "sglang":
        raise ValueError(f"unknown server kind {kind!r}")
    return ServerClient(base_url, request_timeout=request_timeout)
