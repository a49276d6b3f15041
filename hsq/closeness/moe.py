"""The audit's allowance for mixture-of-experts models.

`hsq audit` and `hsq worker --audit-fraction` re-extract a sample alone and compare it
with the stored states of the batched run, row by row (hsq/closeness/rule.py). On a dense model a
correct server keeps every row within the reference tolerance. On an MoE model it need
not: the batch changes the kernels' tiling, a token near a router tie can pick another
expert, and that token's row (and, through attention, a little of the rows after it)
moves. Routing flips are token-local and rare; a mix-up (the reference server's `mix`
fault: another request's states of the same length) moves every row. So for an MoE
architecture a tensor that fails the row rule still matches when

    at most MAX_DEVIATING_ROW_FRACTION of its rows are outside the row tolerance
    (at least one row is always allowed), and
    the median row cosine is >= MIN_COSINE (most rows agree to the dense bound).

Margins, measured (docs/sglang.md, "Audit on MoE"): another sample's rows have cosine
<= 0.62 against a row of the same position (tiny random DeepSeek-V3, every layer), so a
mix-up fails the median by far; routing differences between a bf16 and a float32 forward
(a far larger perturbation than batched vs alone in one server) left at most 7.5 % of rows
outside the row tolerance, a third of the allowance.

Dense architectures keep the strict row rule: nothing routes there, and a stale row is a
real fault. An architecture is MoE when hsq knows it routes (MOE_ARCHITECTURES) or its
name says so ("Moe"/"MoE"), as SGLang and transformers name theirs.

Seam: hsq/closeness/rule.py (`compare_states(..., architecture=...)`) calls `allowance`; the two
audits pass the dump's `meta.model.architecture`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_DEVIATING_ROW_FRACTION = 0.25
MOE_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "KimiVLForConditionalGeneration",
        "MixtralForCausalLM",
        "GptOssForCausalLM",
        "Glm4MoeForCausalLM",
        "Llama4ForCausalLM",
        "Llama4ForConditionalGeneration",
    }
)


def routes_tokens(architecture: str | None) -> bool:
    """Whether the architecture is a mixture of experts (top-k routing per token)."""
    if not architecture:
        return False
    return architecture in MOE_ARCHITECTURES or "moe" in architecture.lower()


@dataclass(frozen=True)
class Allowance:
    ok: bool
    rows: int
    deviating: int
    """Rows outside the row tolerance."""
    median_cosine: float

    @property
    def detail(self) -> str:
        return (
            f"{self.deviating} of {self.rows} rows outside the row tolerance (MoE allowance "
            f"{MAX_DEVIATING_ROW_FRACTION:.0%}), median row cosine {self.median_cosine:.5f}"
        )


def allowance(
    kept: torch.Tensor, fresh: torch.Tensor, *, min_cosine: float, max_abs_of_norm: float
) -> Allowance:
    """Whether `kept` [T, D] may still be `fresh`'s states under routing differences."""
    import torch

    rows = int(kept.shape[0])
    if rows == 0:
        return Allowance(True, 0, 0, 1.0)
    a = kept.float().reshape(rows, -1)
    b = fresh.float().reshape(rows, -1)
    same = (a == b).all(dim=-1)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)
    cos = torch.where(same, torch.ones_like(cos), cos)
    err = (a - b).abs().amax(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
    err = torch.where(same, torch.zeros_like(err), err)
    deviating = int(((cos < min_cosine) | (err > max_abs_of_norm)).sum())
    median = float(cos.median())  # the lower middle for an even count
    allowed = max(1, int(MAX_DEVIATING_ROW_FRACTION * rows))
    return Allowance(deviating <= allowed and median >= min_cosine, rows, deviating, median)
