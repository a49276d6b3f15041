"""The names every file of hidden states shares: dumps, outputs and the SGLang hook.

One home for the vocabulary (the values are on-disk and Redis formats: never change them):

- **dtype** (meta.json `dtype`, RunConfig.dump_dtype, Expected.dtype): the torch dtype the
  model computed the states in, by torch's name: `bfloat16`, `float16`, `float32`
  (DUMP_DTYPES; their safetensors codes are in hsq.stfile.header's one dtype table).
- **encoding** (meta.json and readiness-marker `encoding`): how a server wrote a dump's
  states: `plain` (in `dtype`) or `fp8-e4m3` (quantized on the server, exactly as an
  fp8-e4m3 output stores them).
- **store dtype** (RunConfig.store_dtype, output metadata and manifest `store_dtype`): how a
  run stores its outputs: `bf16` (the states as computed, in the dump's dtype: the name
  predates float16/float32 dumps) or `fp8-e4m3` (hsq/quant.py).

Stdlib only, no torch: the hook's settings (read before torch loads) and operator commands
import it.
"""

from __future__ import annotations

AUX_TENSOR = "aux_hidden_states"
"""[T, k*H]: the k aux layers' states, concatenated in `layer_ids` order."""
LAST_TENSOR = "last_hidden_state"
"""[T, H]: the final layer's output after the model's final norm."""
PRENORM_TENSOR = "last_hidden_state_prenorm"
"""[T, H]: the final layer's output *before* the final norm (runs enqueued with --prenorm)."""
SCALE_SUFFIX = "_scale"
"""`<state>_scale`: the float32 scales of an fp8-e4m3 state tensor, [T, groups]."""

DUMP_DTYPES = ("bfloat16", "float16", "float32")

PLAIN = "plain"
"""Dump encoding: the states in `dtype`, as the model computed them."""
FP8 = "fp8-e4m3"
"""Dump encoding and store dtype: float8_e4m3fn values plus one float32 scale (absmax/448)
per token per row of H values."""
ENCODINGS = (PLAIN, FP8)

BF16 = "bf16"
"""Store dtype: the states as the dump holds them (plain dumps copied, not converted)."""
STORE_DTYPES = (BF16, FP8)


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def state_tensors(num_layers: int, prenorm: bool = False) -> list[tuple[str, int]]:
    """The hidden-state tensors of a dump or output in file order, each with its rows of H
    values per token (the groups an fp8 encoding scales separately)."""
    out = [(AUX_TENSOR, num_layers), (LAST_TENSOR, 1)]
    if prenorm:
        out.append((PRENORM_TENSOR, 1))
    return out
