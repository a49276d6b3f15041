"""Start-up refusals: vLLM settings under which the connector's dumps would be wrong or
partial. Pure: the shim (connector.py) reads the values out of vLLM's config, the launch
command builder checks its own arguments against the same rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hsq.engines.vllm.config import ConnectorConfig
from hsq.engines.vllm.layers import check_captured, layer_problems

ACCEPTED_CACHE_DTYPES = ("auto", "bfloat16", "float16")
"""The KV cache dtypes extract_hidden_states is read to take (models/extract_hidden_states.py
104-107); a quantized target cache (fp8) was never observed with it, so hsq refuses it."""


@dataclass(frozen=True)
class ServingFacts:
    """What the running vLLM is configured to do, as plain values."""

    architecture: str
    num_layers: int
    hidden_size: int
    captured_ids: Sequence[int]
    """``eagle_aux_hidden_state_layer_ids`` of the speculative config, as given."""
    enable_prefix_caching: bool
    cache_dtype: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    context_parallel_size: int = 1
    """Prefill/decode context parallelism: the rows of one request spread over ranks."""
    rank_zero_writes: bool = True
    """Whether the connector's writer is TP rank 0 (ExampleHiddenStatesConnector's rule)."""
    dump_dtype: str = "bfloat16"


def refusals(facts: ServingFacts, cfg: ConnectorConfig) -> list[str]:
    problems = list(layer_problems(cfg.layer_ids, facts.num_layers, facts.architecture))
    if not problems:
        problems += check_captured(facts.captured_ids, cfg.layer_ids, facts.num_layers)
    if facts.enable_prefix_caching:
        # A cached prefix is never computed again, so its rows never reach the capture
        # cache (vLLM #44485): the dump would be partial. --no-enable-prefix-caching.
        problems.append("prefix caching is on (pass --no-enable-prefix-caching)")
    if facts.cache_dtype not in ACCEPTED_CACHE_DTYPES:
        problems.append(
            f"--kv-cache-dtype {facts.cache_dtype}: only {', '.join(ACCEPTED_CACHE_DTYPES)} "
            "were read to work with extract_hidden_states"
        )
    if facts.pipeline_parallel_size != 1:
        # The states live on the last stage; vLLM's writer is TP rank 0 of the first.
        problems.append("pipeline parallelism (--pipeline-parallel-size must be 1)")
    if facts.data_parallel_size != 1:
        problems.append(
            "data parallelism (--data-parallel-size must be 1: one server per worker and dump dir)"
        )
    if facts.context_parallel_size != 1:
        problems.append("context parallelism splits one request's rows over ranks")
    if facts.tensor_parallel_size > 1 and not facts.rank_zero_writes:
        problems.append(
            f"tensor parallel size {facts.tensor_parallel_size} without TP rank 0 as the one "
            "writer (this vLLM's connector does not write from rank 0)"
        )
    if facts.dump_dtype not in ("bfloat16", "float16", "float32"):
        problems.append(f"model dtype {facts.dump_dtype} is not a dump dtype")
    return problems
