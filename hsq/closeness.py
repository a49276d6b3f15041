"""The comparison rule of an audit: are stored hidden states those of a fresh extraction of
the same input, alone? (`hsq audit`, hsq/app/audit.py; a worker's --audit-fraction,
hsq/workers/audit_fraction.py; the reference server's batching bound.)

No check on a dump's metadata can tell that a batching server put request B's rid,
fingerprint and token count on request A's states of the same length: the worker saves them
as B's, and `verify --deep` passes (issue 23 item 20). The states themselves are the only
witness: compute them again, one request at a time (alone in its batch), and compare.

Two extractions of one input agree within the reference tolerance (the bound a batched
forward keeps against a single one, tests/test_inflight.py): per token row of each tensor
(the aux layers concatenated, or the final state)

    cosine(stored, fresh) >= 0.999   and   max |stored - fresh| <= 1% of ||fresh||

A row of another token's states fails it by far (different tokens' states differ in
direction). fp8-e4m3 outputs: the fresh states are quantized the way the output was
(hsq.quant), and a value near a rounding step may land one step (up to 1/14 of the row's
largest value) away, so the absolute bound there is 10% of the norm; the cosine bound stays.

torch is imported inside the functions: `import hsq` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsq.errors import AuditMismatchError

if TYPE_CHECKING:
    import torch

MIN_COSINE = 0.999
MAX_ABS_OF_NORM = 0.01
FP8_MAX_ABS_OF_NORM = 0.1


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
    import torch

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
    if a.shape[0] == 0:
        return Closeness(1.0, 0.0)
    return Closeness(float(cos.min()), float(err.max()))


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str
    """Why not, or the worst figures when it is ok."""
    min_cosine: float = 1.0
    max_abs_over_norm: float = 0.0

    def raise_for_mismatch(self) -> None:
        """AuditMismatchError (reason ``audit_mismatch``) unless the states passed."""
        if not self.ok:
            raise AuditMismatchError(
                f"stored states are not this sample's (audited alone): {self.detail}"
            )


def compare_states(
    stored: Any,
    input_ids: list[int],
    aux: torch.Tensor,
    last: torch.Tensor,
    *,
    architecture: str | None = None,
) -> Verdict:
    """Whether an output file's states (hsq.outputs.open_output) are those of `input_ids`,
    as re-extracted alone into `aux` [T, k*H] and `last` [T, H]. For a mixture-of-experts
    `architecture` (the dump's model), a tensor outside the row rule may still match within
    hsq.audit_moe's allowance for routing differences."""
    from hsq import quant
    from hsq.audit_moe import allowance, routes_tokens
    from hsq.states import FP8

    if stored.input_ids.tolist() != list(input_ids):
        return Verdict(False, "the stored input_ids are not the dataset line's")
    fmt = quant.store_dtype_of(stored.metadata)
    bound = FP8_MAX_ABS_OF_NORM if fmt == FP8 else MAX_ABS_OF_NORM
    worst = Closeness(1.0, 0.0)
    notes: list[str] = []
    for name, fresh, kept in (
        ("aux_hidden_states", aux, stored.aux_hidden_states),
        ("last_hidden_state", last, stored.last_hidden_state),
    ):
        if tuple(fresh.shape) != tuple(kept.shape):
            return Verdict(False, f"{name}: stored {list(kept.shape)}, fresh {list(fresh.shape)}")
        if fmt == FP8:
            groups = max(1, fresh.shape[1] // max(1, last.shape[1]))
            q, scale = quant.quantize(fresh, groups)
            fresh = quant.dequantize(q, scale)
        c = closeness(kept, fresh)
        worst = Closeness(
            min(worst.min_cosine, c.min_cosine), max(worst.max_abs_over_norm, c.max_abs_over_norm)
        )
        if c.min_cosine < MIN_COSINE or c.max_abs_over_norm > bound:
            if routes_tokens(architecture):
                allowed = allowance(kept, fresh, min_cosine=MIN_COSINE, max_abs_of_norm=bound)
                if allowed.ok:
                    notes.append(f"{name}: {allowed.detail}")
                    continue
                return Verdict(
                    False,
                    f"{name} differs from a fresh extraction beyond the MoE allowance: "
                    f"{allowed.detail}",
                    c.min_cosine,
                    c.max_abs_over_norm,
                )
            return Verdict(
                False,
                f"{name} differs from a fresh extraction: worst row cosine "
                f"{c.min_cosine:.4f} (>= {MIN_COSINE} needed), max |diff| "
                f"{c.max_abs_over_norm:.2%} of the row norm (<= {bound:.0%})",
                c.min_cosine,
                c.max_abs_over_norm,
            )
    return Verdict(
        True,
        f"cosine >= {worst.min_cosine:.5f}, max |diff| {worst.max_abs_over_norm:.3%} of norm"
        + "".join(f"; {n}" for n in notes),
        worst.min_cosine,
        worst.max_abs_over_norm,
    )
