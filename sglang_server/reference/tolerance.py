"""How close a batched forward's states must be to the single-request forward.

A batched forward runs the same math on a [B, L] input instead of [1, n]: the GEMM
kernels tile differently and accumulate in another order, so results differ in the last
bits (bf16 compute on the GPU: a few units in the last place; float32 on the CPU: ~1e-6).
Right-padding itself is exact under causal attention. The bound, per token row of each
tensor (the state of one token, all aux layers concatenated, or the final state):

    cosine(batched, single) >= 0.999   and   max |batched - single| <= 1% of ||single||

Both scale with the state, so the same bound holds for a tiny fp32 model and an 8B bf16 one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_COSINE = 0.999
MAX_ABS_OF_NORM = 0.01


@dataclass(frozen=True)
class Closeness:
    min_cosine: float
    """Worst per-row cosine similarity."""
    max_abs_over_norm: float
    """Worst per-row max |a - b| divided by the row's L2 norm."""

    @property
    def ok(self) -> bool:
        return self.min_cosine >= MIN_COSINE and self.max_abs_over_norm <= MAX_ABS_OF_NORM


def closeness(got: torch.Tensor, want: torch.Tensor) -> Closeness:
    """Compare two [T, D] state tensors row by row, in float32."""
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    a = got.float().reshape(got.shape[0], -1)
    b = want.float().reshape(want.shape[0], -1)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)
    # Two all-zero rows are equal; cosine_similarity calls them 0.
    same = (a == b).all(dim=-1)
    cos = torch.where(same, torch.ones_like(cos), cos)
    err = (a - b).abs().amax(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
    err = torch.where(same, torch.zeros_like(err), err)
    return Closeness(float(cos.min()), float(err.max()))
