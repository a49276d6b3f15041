"""FP8 storage of hidden states: per-token absmax scaling to float8_e4m3fn, and back.

Layout of an fp8 output (docs/outputs.md): `aux_hidden_states` [T, k*H] and
`last_hidden_state` [T, H] as float8_e4m3fn, plus float32 scales `aux_hidden_states_scale`
[T, k] (one per token per aux layer) and `last_hidden_state_scale` [T, 1] (and, in runs that
store it, `last_hidden_state_prenorm` [T, H] with its `_scale` [T, 1]). A value is
`q * scale`; scale = absmax / 448 (e4m3fn's largest finite value), so nothing overflows and
the largest magnitude of every row is stored as exactly +-448. A row of zeros has scale 0
and reads back as exact zeros.

Pure functions on tensors; no I/O. torch is imported inside them, so the run config and
operator commands can import the names below without paying for torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from hsq.errors import CorruptDumpError, NonFiniteDumpError, OutputError
from hsq.states import (
    AUX_TENSOR,
    BF16,
    FP8,
    LAST_TENSOR,
    PRENORM_TENSOR,
    STORE_DTYPES,
    scale_name,
)
from hsq.stfile.header import DTYPE_CODES

if TYPE_CHECKING:
    import numpy as np
    import torch

    NDArray = np.ndarray[Any, Any]

META_KEY = "store_dtype"
"""Output metadata key; files written before FP8 existed have none and are bf16."""
FP8_MAX = 448.0
FP8_CODE = DTYPE_CODES["float8_e4m3fn"]
SCALE_CODE = DTYPE_CODES["float32"]
# Below this scale (absmax < ~1e-28) the 448/absmax factor loses range in float32; such rows
# are stored faithfully enough but their largest value need not land exactly on 448.
_EXACT_MAX_MIN_SCALE = 1e-30
CHUNK_TOKENS = 256
_FP8_MAX_BITS = 0x7E  # +-448 in float8_e4m3fn, less its sign bit


def store_dtype_of(metadata: Mapping[str, str]) -> str:
    """The storage format an output file declares (bf16 when it predates the key)."""
    name = metadata.get(META_KEY, BF16)
    if name not in STORE_DTYPES:
        raise OutputError(f"unknown store dtype {name!r} in output metadata")
    return name


def quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, groups*H] floats -> (float8_e4m3fn [T, groups*H], float32 scales [T, groups]).

    Works in chunks of tokens so temporaries stay bounded (float32 of 256 tokens) whatever
    the sample length; every op is a torch kernel, which runs without the GIL. Refuses NaN
    and Inf (NonFiniteDumpError) instead of storing garbage.
    """
    import torch

    if x.dim() != 2 or groups < 1 or x.shape[1] % groups:
        raise ValueError(f"cannot split a {list(x.shape)} tensor into {groups} groups per row")
    t, d = x.shape
    q = torch.empty((t, d), dtype=torch.float8_e4m3fn)
    scale = torch.empty((t, groups), dtype=torch.float32)
    work = torch.empty(min(t, CHUNK_TOKENS) * d, dtype=torch.float32)
    quantize_into(x, groups, q, scale, work)
    return q, scale


def quantize_into(
    x: torch.Tensor, groups: int, q: torch.Tensor, scale: torch.Tensor, work: torch.Tensor
) -> None:
    """quantize() into given tensors: q float8_e4m3fn [T, D], scale float32 [T, groups],
    work a flat float32 scratch of at least D values (CHUNK_TOKENS * D for full speed).
    A caller that quantizes
    sample after sample reuses them: fresh buffers cost page faults, on some VMs more than
    the arithmetic (measured: 22 against 52 us per 8B-shape token)."""
    import torch

    t, d = x.shape
    h = d // groups
    big = torch.finfo(torch.float32).max
    step = max(1, min(CHUNK_TOKENS, work.numel() // max(d, 1)))
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        b = work[: (hi - lo) * d].view(hi - lo, groups, h)
        b.copy_(x[lo:hi].reshape(hi - lo, groups, h))
        # amax and amin, not aminmax: on the CPU aminmax runs ~30x slower (measured).
        amax = torch.maximum(b.amax(dim=-1), b.amin(dim=-1).neg_())  # NaN propagates
        if not bool(torch.isfinite(amax).all()):
            raise NonFiniteDumpError("hidden states hold NaN or Inf; refusing to quantize")
        # Zero rows get factor 0 (q = 0, scale = 0: exact). The clamp keeps the factor
        # finite for absurdly small rows, so x * inv is never inf * 0.
        inv = torch.where(amax > 0, FP8_MAX / amax, 0.0).clamp_(max=big)
        b.mul_(inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        q[lo:hi].view(hi - lo, groups, h).copy_(b)
        torch.div(amax, FP8_MAX, out=scale[lo:hi])


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: Any = None) -> torch.Tensor:
    """float8 [T, g*H] and float32 scales [T, g] -> [T, g*H] in `dtype` (bf16 by default)."""
    import torch

    out_dtype = torch.bfloat16 if dtype is None else dtype
    t, d = q.shape
    g = scale.shape[1]
    if scale.shape[0] != t or d % g:
        raise OutputError(f"scale {list(scale.shape)} does not fit tensor {list(q.shape)}")
    y = q.reshape(t, g, d // g).float().mul_(scale.reshape(t, g, 1))
    return y.to(out_dtype).reshape(t, d)


def quantized_problems(q: torch.Tensor | NDArray, scale: torch.Tensor | NDArray) -> list[str]:
    """Deep checks of one stored fp8 tensor against its scales (empty list: fine).

    Beyond the checksum, this catches a scale tensor that was written wrong: scales must be
    finite and >= 0, a zero scale must go with an all-zero row, a row with a scale must
    reach +-448 (the quantizer maps each row's absmax there), and scale * 448 must be
    finite (else the values read back as Inf). `verify --deep` reports these; the worker
    refuses a server-made fp8 dump by the same rules (check_quantized). Pure: tensors in,
    text out, so any process (a pool's too) can run it. `q` is a float8_e4m3fn tensor or
    its bits as a uint8 array, `scale` float32 (tensor or array): the rules run in numpy,
    so the base install (no torch) checks files too (hsq.stfile.tensors)."""
    return [text for _, text in _problems(q, scale)]


def check_quantized(q: torch.Tensor | NDArray, scale: torch.Tensor | NDArray, name: str) -> None:
    """quantized_problems as a dump's error: NonFiniteDumpError where a value or its
    dequantization is not finite, CorruptDumpError for the other rules."""
    found = _problems(q, scale)
    if not found:
        return
    text = f"{name}: " + "; ".join(t for _, t in found)
    if any(nonfinite for nonfinite, _ in found):
        raise NonFiniteDumpError(text)
    raise CorruptDumpError(text)


def _as_arrays(q: Any, scale: Any) -> tuple[NDArray, NDArray] | str:
    """(uint8 bits [T, D], float32 [T, g]) from tensors or arrays; text when the dtypes are
    wrong. A CPU tensor is viewed, not copied."""
    import numpy as np

    if isinstance(q, np.ndarray) and isinstance(scale, np.ndarray):
        if q.dtype != np.uint8 or scale.dtype != np.float32:
            return f"dtypes {q.dtype}/{scale.dtype}, expected uint8 (fp8 bits)/float32"
        return q, scale
    import torch

    if q.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        return f"dtypes {q.dtype}/{scale.dtype}, expected float8_e4m3fn/float32"
    return q.detach().cpu().view(torch.uint8).numpy(), scale.detach().cpu().numpy()


def _problems(q: Any, scale: Any) -> list[tuple[bool, str]]:
    """(is it about NaN/Inf, what) for every rule a stored fp8 tensor breaks."""
    import numpy as np

    arrays = _as_arrays(q, scale)
    if isinstance(arrays, str):
        return [(False, arrays)]
    bits, sc = arrays
    if bits.ndim != 2:
        return [(False, f"fp8 tensor shape {list(bits.shape)} is not [tokens, width]")]
    t, d = bits.shape
    if sc.ndim != 2 or sc.shape[0] != t or sc.shape[1] < 1 or d % sc.shape[1]:
        return [(False, f"scale shape {list(sc.shape)} does not fit {list(bits.shape)}")]
    problems: list[tuple[bool, str]] = []
    with np.errstate(all="ignore"):  # an overflow is a finding here, not a warning
        if not bool(np.isfinite(sc).all()):
            problems.append((True, "scale holds NaN or Inf"))
        elif bool((sc < 0).any()):
            problems.append((False, "scale holds negative values"))
        elif not bool(np.isfinite(sc * np.float32(FP8_MAX)).all()):
            problems.append((True, "scale * 448 overflows float32: the values read back as Inf"))
    # e4m3fn is sign-magnitude: the low 7 bits order magnitudes, 0x7F is its only NaN
    # (no Inf), 0x7E is 448 and 0x00 zero.
    mag = bits & np.uint8(0x7F)
    if bool((mag == 0x7F).any()):
        return [*problems, (True, "values hold NaN")]
    if problems:
        return problems
    g = sc.shape[1]
    rowmax = mag.reshape(t, g, d // g).max(axis=-1, initial=0)
    if bool(((sc == 0) & (rowmax != 0)).any()):
        problems.append((False, "a zero scale on a row that is not all zero"))
    if bool(((sc > _EXACT_MAX_MIN_SCALE) & (rowmax != _FP8_MAX_BITS)).any()):
        problems.append((False, "a row's largest value is not +-448: scale and values disagree"))
    return problems


class _Info(Protocol):
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...


def layout_problems(
    store_dtype: str, tensors: Mapping[str, _Info], num_tokens: int, groups: int | None
) -> list[str]:
    """Header-level checks of the hidden-state tensors for a file's declared format.
    `groups` is the number of aux layers (None: not known, not checked)."""
    problems = []
    for name, want_groups in ((AUX_TENSOR, groups), (LAST_TENSOR, 1), (PRENORM_TENSOR, 1)):
        info = tensors.get(name)
        if info is None:
            if name == PRENORM_TENSOR and scale_name(name) in tensors:
                problems.append(f"{scale_name(name)} without {name}")
            continue  # the caller reports missing base tensors (PRENORM is optional)
        is_fp8 = info.dtype == FP8_CODE
        if is_fp8 != (store_dtype == FP8):
            problems.append(f"{name} is {info.dtype} in a {store_dtype} file")
        if want_groups is not None and (len(info.shape) != 2 or info.shape[1] % want_groups):
            problems.append(f"{name} shape {info.shape} does not split into {want_groups} rows")
        sc = tensors.get(scale_name(name))
        if store_dtype == BF16:
            if sc is not None:
                problems.append(f"{scale_name(name)} in a bf16 file")
            continue
        if sc is None:
            problems.append(f"{scale_name(name)} missing")
            continue
        want = [num_tokens, want_groups] if want_groups is not None else None
        if sc.dtype != SCALE_CODE or len(sc.shape) != 2 or sc.shape[0] != num_tokens:
            problems.append(f"{scale_name(name)} is {sc.dtype}{sc.shape}")
        elif want is not None and sc.shape != want:
            problems.append(f"{scale_name(name)} shape {sc.shape}, expected {want}")
    return problems


def logical_tensors(
    stored: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    raw: bool = False,
    dtype: Any = None,
) -> dict[str, torch.Tensor]:
    """An output file's tensors as training wants them, whatever the storage format.

    Default: `aux_hidden_states` and `last_hidden_state` in bf16 (fp8 files dequantized,
    scale tensors dropped), input_ids and loss_mask as stored. `raw=True` hands back what is
    stored (fp8 values plus the `*_scale` tensors for fp8 files). bf16 files come back as is.
    """
    fmt = store_dtype_of(metadata)
    out = dict(stored)
    if fmt == BF16 or raw:
        return out
    for name in (AUX_TENSOR, LAST_TENSOR, PRENORM_TENSOR):
        sname = scale_name(name)
        if name == PRENORM_TENSOR and name not in stored and sname not in stored:
            continue  # optional: only runs enqueued with --prenorm store it
        if name not in stored or sname not in stored:
            raise OutputError(f"fp8 output lacks {name} or {sname}")
        out[name] = dequantize(stored[name], stored[sname], dtype)
        del out[sname]
    return out


def quantize_on_device(
    x: torch.Tensor, groups: int, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` for a server: on x's device (a GPU), without ever waiting for it.

    Bit for bit the same values and scales as `quantize` (the same float32 operations;
    tests/test_fp8.py compares them), but NaN and Inf are not checked here: checking would
    synchronize the device with the host in the middle of serving. They travel on instead
    (a NaN row gets a NaN scale) and the worker's finite check refuses the dump.
    Temporaries are bounded by `chunk_tokens` tokens of float32.
    """
    import torch

    if x.dim() != 2 or groups < 1 or x.shape[1] % groups:
        raise ValueError(f"cannot split a {list(x.shape)} tensor into {groups} groups per row")
    t, d = x.shape
    h = d // groups
    q = torch.empty((t, d), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    big = torch.finfo(torch.float32).max
    for lo in range(0, t, chunk_tokens):
        hi = min(t, lo + chunk_tokens)
        b = x[lo:hi].reshape(hi - lo, groups, h).to(torch.float32, copy=True)  # never x
        # amax/amin of the float32 copy: NaN propagates into the scale, as with `quantize`.
        amax = torch.maximum(b.amax(dim=-1), b.amin(dim=-1).neg_())
        inv = torch.where(amax > 0, FP8_MAX / amax, 0.0).clamp_(max=big)
        b.mul_(inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        q[lo:hi].view(hi - lo, groups, h).copy_(b)
        scale[lo:hi] = amax / FP8_MAX
    return q, scale
