"""How close a batched forward's states must be to the single-request forward.

A batched forward runs the same math on a [B, L] input instead of [1, n]: the GEMM
kernels tile differently and accumulate in another order, so results differ in the last
bits (bf16 compute on the GPU: a few units in the last place; float32 on the CPU: ~1e-6).
Right-padding itself is exact under causal attention. The bound, per token row of each
tensor (the state of one token, all aux layers concatenated, or the final state):

    cosine(batched, single) >= 0.999   and   max |batched - single| <= 1% of ||single||

Both scale with the state, so the same bound holds for a tiny fp32 model and an 8B bf16 one.
It is defined once, in hsq/closeness/rule.py, where `hsq audit` and a worker's --audit-fraction use
it to find states that belong to another request.
"""

from __future__ import annotations

from hsq.closeness.rule import MAX_ABS_OF_NORM, MIN_COSINE, Closeness, closeness

__all__ = ["MAX_ABS_OF_NORM", "MIN_COSINE", "Closeness", "closeness"]
