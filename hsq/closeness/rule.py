"""The comparison rule of an audit: are stored hidden states those of a fresh extraction of
the same input, alone? (`hsq audit`, hsq/ops/audit.py; a worker's --audit-fraction,
hsq/workers/audit_fraction.py; the reference server's batching bound.)

No check on a dump's metadata can tell that a batching server put request B's rid,
fingerprint and token count on request A's states of the same length: the worker saves them
as B's, and `verify --deep` passes. The states themselves are the only
witness: compute them again, one request at a time (alone in its batch), and compare.

Two extractions of one input agree within the reference tolerance (the bound a batched
forward keeps against a single one, tests/test_inflight.py): per token row of each tensor
(the aux layers concatenated, the final state, the pre-norm state where stored)

    cosine(stored, fresh) >= 0.999   and   max |stored - fresh| <= 1% of ||fresh||

A row of another token's states fails it by far (different tokens' states differ in
direction).

Every tensor is compared as the states it stands for: fp8-e4m3 values times their scales
(an output's and a server-made dump's alike), in float32. The fp8 rounding then adds to
the bound, once per side that was quantized (fp8 vs plain: one; fp8 vs fp8: two, as each
side rounds on its own). e4m3 keeps 3 mantissa bits: neighbouring values of one binade are
2^-3 of its lower end apart, so rounding to nearest moves a value by at most 2^-4 of
itself (FP8_ROUNDING); below the smallest normal (2^-6 in units of the scale) the step
is 2^-9 and the move at most 2^-10 scales, which over a row of D values adds at most
sqrt(D) * 2^-10 / 448 of the row's norm (the scale is the row's absmax / 448). So per
quantized side the error vector's norm is at most delta = 2^-4 + sqrt(D) * 2^-10 / 448 of
the row's, its angle at most asin(delta), and its largest element at most 2^-4 of the
row's largest one (<= its norm):

    cosine >= cos(acos(0.999) + n * asin(delta))          fp8 vs plain 0.9942, fp8 vs fp8 0.9856
    max |diff| <= 1% + n * 2^-4 * 1.1 of ||fresh||        fp8 vs plain 7.9%,   fp8 vs fp8 14.8%

(1.1: the two norms of a matching pair agree to a few percent; the figures are for
D = 4096). Another token's rows stay far outside these (tests/test_audit.py measures it
on the reference model).

A comparison that cannot be trusted decides nothing (`Verdict.trusted` False): stored
states that do not dequantize to finite values (`verify --deep`'s matter, not the audit's),
a stored tensor the fresh extraction lacks, or shapes that differ. And a mismatch is only
a mismatch once a second fresh extraction confirms it (`confirm`): the second must fail
against the stored states too and agree with the first, else the audit server is not
reproducible and nothing is removed.

torch is imported inside the functions: `import hsq` stays light.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsq.errors import AuditMismatchError, OutputError
from hsq.states import FP8, PLAIN, scale_name, state_tensors

if TYPE_CHECKING:
    import torch

    from hsq.dump.read import Dump

MIN_COSINE = 0.999
MAX_ABS_OF_NORM = 0.01
FP8_MANTISSA_BITS = 3
FP8_ROUNDING = 2.0 ** -(FP8_MANTISSA_BITS + 1)
"""The most rounding to nearest moves a normal e4m3 value, relative to the value: 2^-4."""
FP8_SUBNORMAL_ERROR = 2.0**-10
"""The most rounding moves a subnormal e4m3 value, in units of the row's scale."""
FP8_MAX = 448.0
NORM_SLACK = 0.1
"""How far the norms of two extractions of one row may differ, as a fraction: the absolute
bound is relative to the fresh row's norm, the stored side's rounding to its own."""


@dataclass(frozen=True)
class Tolerance:
    min_cosine: float
    max_abs_of_norm: float

    def admits(self, c: Closeness) -> bool:
        return c.min_cosine >= self.min_cosine and c.max_abs_over_norm <= self.max_abs_of_norm


def tolerance(fp8_sides: int = 0, width: int = 0) -> Tolerance:
    """The bound for rows of `width` values when `fp8_sides` (0, 1 or 2) of the two
    compared tensors were quantized to fp8-e4m3 (the module's docstring derives it)."""
    if fp8_sides == 0:
        return Tolerance(MIN_COSINE, MAX_ABS_OF_NORM)
    delta = FP8_ROUNDING + math.sqrt(max(width, 1)) * FP8_SUBNORMAL_ERROR / FP8_MAX
    angle = math.acos(MIN_COSINE) + fp8_sides * math.asin(min(1.0, delta))
    return Tolerance(
        math.cos(min(angle, math.pi)),
        MAX_ABS_OF_NORM + fp8_sides * FP8_ROUNDING * (1 + NORM_SLACK),
    )


FP8_MAX_ABS_OF_NORM = 0.1
"""The GPU equality checks' absolute bound (tests/gpu/equality.py) for an fp8 output
against reference states quantized the same way (the cosine bound stays 0.999 there): a
value near a rounding step lands one step, up to 1/14 of the row's largest, away. The
audit uses tolerance() instead, which also covers two independent roundings."""


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
class States:
    """One extraction's (or one file's) hidden states as the values they stand for:
    float32 [T, D] by tensor name, fp8 ones dequantized; `encoding` says how they were
    held (PLAIN or FP8), which the tolerance depends on."""

    tensors: dict[str, Any]
    encoding: str


def _decode(raw: dict[str, Any], names: list[str], encoding: str, what: str) -> States:
    import torch

    from hsq import quant

    out: dict[str, Any] = {}
    for name in names:
        if name not in raw:
            continue
        if encoding == FP8:
            sname = scale_name(name)
            if sname not in raw:
                raise ValueError(f"{what}: {name} has no {sname}")
            out[name] = quant.dequantize(raw[name], raw[sname], torch.float32)
        else:
            out[name] = raw[name].float()
    return States(out, encoding)


def dump_states(dump: Dump) -> States:
    """A fresh extraction's states: a server-made fp8 dump's values times its scales."""
    meta = dump.meta
    names = [n for n, _ in state_tensors(len(meta.layer_ids), meta.prenorm)]
    encoding = FP8 if meta.encoding == FP8 else PLAIN
    return _decode(dump.tensors, names, encoding, f"dump {dump.path.name}")


def output_states(stored: Any) -> States:
    """An output file's states (an OutputSample of hsq.outputs.open_output(path, raw=True)):
    an fp8 file's values times its scales. A file opened without raw=True is taken as the
    bf16 values open_output decoded (one more rounding, inside the bound's slack)."""
    from hsq import quant
    from hsq.states import AUX_TENSOR, LAST_TENSOR, PRENORM_TENSOR

    raw = {AUX_TENSOR: stored.aux_hidden_states, LAST_TENSOR: stored.last_hidden_state}
    if getattr(stored, "last_hidden_state_prenorm", None) is not None:
        raw[PRENORM_TENSOR] = stored.last_hidden_state_prenorm
    fp8 = quant.store_dtype_of(stored.metadata) == FP8
    scales = dict(getattr(stored, "scales", None) or {})
    if fp8 and scales:
        return _decode({**raw, **scales}, list(raw), FP8, f"output {stored.sample_id}")
    return States({k: v.float() for k, v in raw.items()}, FP8 if fp8 else PLAIN)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str
    """Why not, or the worst figures when it is ok."""
    min_cosine: float = 1.0
    max_abs_over_norm: float = 0.0
    trusted: bool = True
    """False: the comparison cannot decide (see the module docstring); never act on it."""

    @property
    def mismatch(self) -> bool:
        """A trusted comparison that failed: the stored states are not the sample's."""
        return self.trusted and not self.ok

    def raise_for_mismatch(self) -> None:
        """AuditMismatchError (reason ``audit_mismatch``) for a trusted mismatch."""
        if self.mismatch:
            raise AuditMismatchError(
                f"stored states are not this sample's (audited alone): {self.detail}"
            )


def _untrusted(detail: str) -> Verdict:
    return Verdict(False, detail, trusted=False)


def compare(stored: States, fresh: States, *, architecture: str | None = None) -> Verdict:
    """Whether `stored` holds `fresh`'s states, tensor by tensor (every stored one), within
    the tolerance of the two encodings. For a mixture-of-experts `architecture` (the
    dump's model), a tensor outside the row rule may still match within hsq.closeness.moe's
    allowance for routing differences."""
    import torch

    from hsq.closeness.moe import allowance, routes_tokens

    fp8_sides = (stored.encoding == FP8) + (fresh.encoding == FP8)
    worst = Closeness(1.0, 0.0)
    notes: list[str] = []
    for name, kept in stored.tensors.items():
        new = fresh.tensors.get(name)
        if new is None:
            return _untrusted(f"{name} is stored and the fresh extraction has none")
        if tuple(new.shape) != tuple(kept.shape):
            return _untrusted(f"{name}: stored {list(kept.shape)}, fresh {list(new.shape)}")
        for what, t in (("stored", kept), ("fresh", new)):
            if not bool(torch.isfinite(t).all()):
                return _untrusted(f"{name}: the {what} states are not finite (verify --deep)")
        tol = tolerance(fp8_sides, int(kept.shape[1]) if kept.dim() == 2 else 0)
        c = closeness(kept, new)
        worst = Closeness(
            min(worst.min_cosine, c.min_cosine), max(worst.max_abs_over_norm, c.max_abs_over_norm)
        )
        if tol.admits(c):
            continue
        if routes_tokens(architecture):
            allowed = allowance(
                kept, new, min_cosine=tol.min_cosine, max_abs_of_norm=tol.max_abs_of_norm
            )
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
            f"{c.min_cosine:.4f} (>= {tol.min_cosine:.4f} needed), max |diff| "
            f"{c.max_abs_over_norm:.2%} of the row norm (<= {tol.max_abs_of_norm:.1%}; "
            f"{stored.encoding} stored, {fresh.encoding} fresh)",
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


def compare_states(
    stored: Any, input_ids: list[int], fresh: States, *, architecture: str | None = None
) -> Verdict:
    """Whether an output file (an OutputSample, best opened with raw=True) holds the
    states of `input_ids` as `fresh` re-extracted them alone."""
    if stored.input_ids.tolist() != list(input_ids):
        return Verdict(False, "the stored input_ids are not the dataset line's")
    try:
        kept = output_states(stored)
    except (ValueError, OutputError) as exc:
        return _untrusted(f"the stored states cannot be decoded: {exc}")
    return compare(kept, fresh, architecture=architecture)


def confirm(first: Verdict, second: Verdict, repeat: Verdict) -> Verdict:
    """The verdict on a sample whose `first` comparison failed, given a second fresh
    extraction: `second` (stored vs the second) and `repeat` (the first vs the second).
    A mismatch stands only if the second extraction fails the stored states too and
    agrees with the first; otherwise the comparison is not trusted."""
    if not first.mismatch:
        return first
    if not repeat.ok:
        return _untrusted(
            f"the audit server's two extractions of the sample disagree ({repeat.detail}): "
            f"it is not reproducible, so its first comparison ({first.detail}) decides nothing"
        )
    if second.ok:
        return _untrusted(
            f"not reproduced: a second fresh extraction matches the stored states "
            f"({second.detail}); the first did not ({first.detail})"
        )
    if not second.trusted:
        return second
    return Verdict(
        False,
        f"{first.detail} (confirmed by a second fresh extraction)",
        min(first.min_cosine, second.min_cosine),
        max(first.max_abs_over_norm, second.max_abs_over_norm),
    )
