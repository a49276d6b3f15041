"""The live equality check: stored states against the reference forward, row by row, and
the faults it must catch, planted into real stored states.

Pure (torch only): tests/test_live_equality.py runs it on a CPU with synthetic states.

The rule is the reference server's (hsq.closeness.rule): every token row of every stored tensor
(aux layers concatenated, final post-norm, pre-norm where stored) has cosine >= 0.999 and
max |d| <= 1% of the row norm against the reference (fp8 outputs: against the reference
quantized the same way, max |d| <= 10%). On an MoE model it holds only against a forward
that replays the server's expert choices (tests/gpu/reference.py); the free-routing
comparison is reported beside it, never judged, to show why.

Planted faults (each must fail on every sample):
  off_by_one  the stored aux states against the reference one layer further on (a hook
              that took layer i+1 for i would store exactly those)
  swapped     another sample's stored states (over the rows both have)
  stale_row   one row, in the middle of the sample, replaced in every stored tensor by the
              same row of another sample (a buffer overwritten by the next forward)
  stale_shift one row replaced by the row before it in the same sample (an off-by-one row
              mapping)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hsq.closeness.rule import FP8_MAX_ABS_OF_NORM, MAX_ABS_OF_NORM, MIN_COSINE

AUX, LAST_NAME, PRENORM_NAME = "aux_hidden_states", "last_hidden_state", "last_hidden_state_prenorm"
BINS = (0.5, 0.9, 0.99, 0.999, 0.9999)
"""Histogram edges of per-row cosines: [<0.5, 0.5-0.9, 0.9-0.99, 0.99-0.999, 0.999-0.9999,
>=0.9999]."""
QUANTILES = (0.0, 0.001, 0.01, 0.1, 0.5)


def row_figures(got: Any, want: Any) -> tuple[Any, Any]:
    """Per-row cosine and max |got - want| / ||want|| of two [T, D] tensors, in float32."""
    import torch

    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    a = got.float().reshape(got.shape[0], -1)
    b = want.float().reshape(want.shape[0], -1)
    same = (a == b).all(dim=-1)  # two zero rows are equal; cosine_similarity calls them 0
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)
    cos = torch.where(same, torch.ones_like(cos), cos)
    err = (a - b).abs().amax(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
    err = torch.where(same, torch.zeros_like(err), err)
    return cos, err


@dataclass(frozen=True)
class Comparison:
    """One sample's stored tensors against one expectation."""

    rows: int
    bad_rows: int
    """Rows (token positions) where any tensor is outside the tolerance."""
    min_cosine: float
    max_abs_over_norm: float
    cosines: tuple[float, ...] = ()
    """Per row, the worst cosine over the tensors."""
    verdict: bool | None = None
    """Set by a rule that allows some bad rows (compare_moe); None: no bad row allowed."""

    @property
    def ok(self) -> bool:
        return self.bad_rows == 0 if self.verdict is None else self.verdict


def compare(got: Mapping[str, Any], want: Mapping[str, Any], *, fp8: bool = False) -> Comparison:
    """`got` and `want` by tensor name (the names of `want` are compared; rows past the
    shorter of the two are not)."""
    import torch

    bound = FP8_MAX_ABS_OF_NORM if fp8 else MAX_ABS_OF_NORM
    worst_cos: Any = None
    bad: Any = None
    worst_err = 0.0
    for name, w in want.items():
        g = got[name]
        n = min(g.shape[0], w.shape[0])
        cos, err = row_figures(g[:n], w[:n])
        row_bad = (cos < MIN_COSINE) | (err > bound)
        if worst_cos is None:
            worst_cos, bad = cos, row_bad
        else:
            n = min(n, worst_cos.shape[0])
            worst_cos = torch.minimum(worst_cos[:n], cos[:n])
            bad = bad[:n] | row_bad[:n]
        worst_err = max(worst_err, float(err.max()) if err.numel() else 0.0)
    if worst_cos is None or worst_cos.numel() == 0:
        return Comparison(0, 0, 1.0, 0.0)
    return Comparison(
        rows=int(worst_cos.shape[0]),
        bad_rows=int(bad.sum()),
        min_cosine=float(worst_cos.min()),
        max_abs_over_norm=worst_err,
        cosines=tuple(float(c) for c in worst_cos),
    )


def compare_moe(
    got: Mapping[str, Any],
    want: Mapping[str, Any],
    *,
    aux_layers: int,
    dense_aux: int,
    fp8: bool = False,
) -> Comparison:
    """An MoE sample without the server's expert choices: the first `dense_aux` aux layers
    (computed before the first MoE layer, so no routing reaches them) row by row, every
    row within the tolerance; the rest under hsq's MoE allowance (hsq.closeness.moe: at most
    a quarter of the rows outside the tolerance, median row cosine >= MIN_COSINE). A stale
    or shifted row fails the strict part; another sample's states and a wrong layer fail
    both."""
    from hsq.closeness.moe import MAX_DEVIATING_ROW_FRACTION

    aux_g, aux_w = got[AUX], want[AUX]
    cols = aux_w.shape[-1] * dense_aux // aux_layers
    strict = compare({AUX: aux_g[:, :cols]}, {AUX: aux_w[:, :cols]}, fp8=fp8) if cols else None
    rest_w = {f"{AUX}_moe": aux_w[:, cols:], **{k: v for k, v in want.items() if k != AUX}}
    rest_g = {f"{AUX}_moe": aux_g[:, cols:], **{k: got[k] for k in rest_w if k != f"{AUX}_moe"}}
    loose = compare(rest_g, rest_w, fp8=fp8)
    cos = sorted(loose.cosines)
    median = cos[(len(cos) - 1) // 2] if cos else 1.0
    allowed = max(1, int(MAX_DEVIATING_ROW_FRACTION * loose.rows))
    loose_ok = loose.bad_rows <= allowed and median >= MIN_COSINE
    if strict is None:
        return Comparison(loose.rows, loose.bad_rows, loose.min_cosine,
                          loose.max_abs_over_norm, loose.cosines, loose_ok)  # fmt: skip
    n = min(strict.rows, loose.rows)
    worst = tuple(min(a, b) for a, b in zip(strict.cosines[:n], loose.cosines[:n], strict=True))
    return Comparison(
        rows=n,
        bad_rows=strict.bad_rows + loose.bad_rows,
        min_cosine=min(strict.min_cosine, loose.min_cosine),
        max_abs_over_norm=max(strict.max_abs_over_norm, loose.max_abs_over_norm),
        cosines=worst,
        verdict=strict.ok and loose_ok,
    )


def stored_tensors(output: Any) -> dict[str, Any]:
    """The state tensors of an output file (hsq.outputs.open_output), dequantized."""
    out = {AUX: output.aux_hidden_states, LAST_NAME: output.last_hidden_state}
    pre = getattr(output, "last_hidden_state_prenorm", None)
    if pre is not None:
        out[PRENORM_NAME] = pre
    return out


def expected_tensors(
    ref: Mapping[int | str, Any],
    layer_ids: Sequence[int],
    *,
    prenorm: bool,
    fp8: bool,
    last_key: str = "last",
    prenorm_key: str = "prenorm",
) -> dict[str, Any]:
    """What an output should hold, from a reference forward's states (reference.py keys),
    quantized as an fp8 output is when `fp8`."""
    import torch

    want = {
        AUX: torch.cat([ref[i] for i in layer_ids], dim=-1),
        LAST_NAME: ref[last_key],
    }
    if prenorm:
        want[PRENORM_NAME] = ref[prenorm_key]
    if fp8:
        from hsq import quant

        groups = {AUX: len(layer_ids), LAST_NAME: 1, PRENORM_NAME: 1}
        for name, t in list(want.items()):
            q, scale = quant.quantize(t, groups[name])
            want[name] = quant.dequantize(q, scale)
    return want


def shifted(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The ids one layer further on (or one back, where +1 leaves the model)."""
    up = [i + 1 for i in layer_ids]
    return up if max(up) < num_layers else [i - 1 for i in layer_ids]


def with_row(
    stored: Mapping[str, Any], donor: Mapping[str, Any], row: int, src: int
) -> dict[str, Any]:
    """`stored` with row `row` of every tensor replaced by `donor`'s row `src`."""
    out = {}
    for name, t in stored.items():
        t2 = t.clone()
        t2[row] = donor[name][src]
        out[name] = t2
    return out


@dataclass
class Distribution:
    """Per-row cosines of one kind of comparison over many samples, summarized."""

    kind: str
    cosines: list[float] = field(default_factory=list)
    samples: int = 0
    samples_failed: int = 0

    def add(self, c: Comparison, rows: Sequence[int] | None = None) -> None:
        self.samples += 1
        self.samples_failed += not c.ok
        picked = c.cosines if rows is None else [c.cosines[r] for r in rows if r < c.rows]
        self.cosines.extend(picked)

    def summary(self) -> dict[str, Any]:
        import torch

        if not self.cosines:
            return {"kind": self.kind, "samples": self.samples, "rows": 0}
        t = torch.tensor(self.cosines, dtype=torch.float64)
        edges = [float("-inf"), *BINS, float("inf")]
        hist = [int(((t >= lo) & (t < hi)).sum()) for lo, hi in itertools.pairwise(edges)]
        return {
            "kind": self.kind,
            "samples": self.samples,
            "samples_failed": self.samples_failed,
            "rows": int(t.numel()),
            "quantiles": {f"q{q:g}": round(float(torch.quantile(t, q)), 6) for q in QUANTILES},
            "max": round(float(t.max()), 6),
            "hist": dict(zip(_bin_names(), hist, strict=True)),
        }


def _bin_names() -> list[str]:
    edges = ["", *(f"{b:g}" for b in BINS), ""]
    return [
        f"<{edges[1]}"
        if i == 0
        else f">={edges[i]}"
        if i == len(BINS)
        else f"{edges[i]}-{edges[i + 1]}"
        for i in range(len(BINS) + 1)
    ]
