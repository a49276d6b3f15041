"""The worker's client for stock vLLM with hsq's connector (hsq/engines/vllm/).

One prefill is a ``/v1/completions`` request: the prompt as token ids, ``max_tokens: 1``
(vLLM requires at least one sampled token: prefill plus one decode step, whose state is
never dumped), and the worker's rid both as the request id and in ``kv_transfer_params``,
where the connector reads it (vLLM's own request id gets a prefix and a random suffix, so
the connector cannot take it from there). Errors are ServerClient's.
"""

from __future__ import annotations

from typing import Any

from hsq.errors import ServerRejectedError
from hsq.workers.send.client import PrefillAnswer, ServerClient

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
