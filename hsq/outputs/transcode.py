"""From a validated dump to its sample's output file, in one pass, written durably.

The one writer of output files (the worker's persist stage calls it; hsq/workers/persist/stage.py).
The call path reads one way: the output's layout and metadata (hsq.outputs.format), the
dump's tensors as sources (hsq.dump.read.DumpTensors), fp8 quantized on the way
(hsq.quant), the bytes through the persist stage's write engine (hsq.stfile.engine) into a
temp file that takes its name without replacing any (hsq.outputs.publish).
"""

from __future__ import annotations

import array
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsq import quant
from hsq.dataset.jsonl import Sample
from hsq.errors import CorruptDumpError, MetaMismatchError, NonFiniteDumpError
from hsq.fsio import write_durably
from hsq.outputs.format import IDS_TENSOR, MASK_TENSOR, output_metadata
from hsq.outputs.publish import Publisher
from hsq.states import BF16, FP8, scale_name, state_tensors
from hsq.stfile.engine import Produced, Source, SourceError, WriteEngine
from hsq.stfile.header import DTYPE_CODES, ITEMSIZE, TensorInfo, build_header, torch_dtype
from hsq.stfile.header import tensor_bytes as raw_bytes
from hsq.stfile.integrity import NonFiniteError

if TYPE_CHECKING:
    from hsq.dump.format import DumpMeta
    from hsq.dump.read import DumpTensors

_I64 = DTYPE_CODES["int64"]
_F32 = DTYPE_CODES["float32"]


def write_output(
    path: Path,
    sample: Sample,
    meta: DumpMeta,
    dump: DumpTensors,
    run: str,
    store_dtype: str = BF16,
    *,
    engine: WriteEngine,
    prenorm: bool = False,
    stats: dict[str, float] | None = None,
    before_rename: Callable[[], None] | None = None,
) -> tuple[int, str]:
    """Write a sample's training file durably from a dump whose header was checked;
    (bytes, checksum "xxh3:<hex>").

    One pass over the dump's bytes, read with pread into buffers of the writer's own (never
    the dump's mapping): bf16 states are checked for NaN/Inf, checksummed and written from
    those very bytes; fp8 states are quantized from them (the quantizer refuses NaN/Inf).
    So a dump rewritten while it is copied cannot put unchecked bytes on disk.
    NonFiniteDumpError or CorruptDumpError for a bad dump, OutputError when the disk
    refuses. `stats` gathers seconds per step; `before_rename` runs after the fsync, right
    before the file takes its name, and may raise to leave nothing behind.
    An fp8-e4m3 dump (the server quantized it) is copied as it is, read the same way: its
    scales first, then its values a chunk of tokens at a time, each chunk checked against
    its scales by the rules `verify --deep` applies (hsq.quant.check_quantized: finite
    values and scales, a zero scale only on an all-zero row, every row reaching +-448,
    scale * 448 finite) before it is written. `prenorm`: the run stores
    last_hidden_state_prenorm (a dump that has it in a run that does not: left out).
    """
    n = len(sample.input_ids)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    if prenorm and not meta.prenorm:
        raise MetaMismatchError("the run stores the pre-norm final state; the dump has none")
    states = state_tensors(len(meta.layer_ids), prenorm)
    metadata = output_metadata(sample, meta, run, store_dtype)
    entries: list[tuple[str, str, list[int], int]] = [
        (IDS_TENSOR, _I64, [n], 8 * n),
        (MASK_TENSOR, _I64, [n], 8 * n),
    ]
    sources: list[Source] = [_int64_bytes(sample.input_ids), _int64_bytes(mask)]
    if meta.encoding == FP8:
        if store_dtype != FP8:  # check_meta refuses it first; never store a mix
            raise MetaMismatchError(f"an {FP8} dump cannot be stored as {store_dtype}")
        copied: list[str] = []
        for name, _groups in states:  # checked by the rules verify --deep applies
            info, sinfo = dump.header.tensors[name], dump.header.tensors[scale_name(name)]
            q, scales = _checked_fp8_copy(dump.fd, info, sinfo, stats)
            entries += [
                (info.name, info.dtype, info.shape, info.nbytes),
                (sinfo.name, sinfo.dtype, sinfo.shape, sinfo.nbytes),
            ]
            sources += [q, scales]
    elif store_dtype == FP8:
        copied = []
        for name, groups in states:
            info = dump.header.tensors[name]
            q, scales = _fp8_sources(dump.fd, info, groups, stats)
            entries += [
                (name, quant.FP8_CODE, list(info.shape), q.nbytes),
                (scale_name(name), _F32, [info.shape[0], groups], scales.nbytes),
            ]
            sources += [q, scales]
    else:
        copied = [name for name, _ in states]
    for name in copied:
        info = dump.header.tensors[name]
        entries.append((info.name, info.dtype, info.shape, info.nbytes))
        sources.append(dump.source(name))
    header = build_header(entries, metadata)
    # The file takes its name only where none is (a valid one there is adopted): no
    # writer replaces another's, so a done mark always names the file on disk (a worker woken
    # after a stop once replaced the file another worker had redone and marked).
    publish = Publisher(sample, meta, run, store_dtype, prenorm, stats)
    try:
        return write_durably(
            path,
            lambda fd: engine.write(fd, header, sources, stats=stats),
            stats=stats,
            before_rename=before_rename,
            publish=publish,
        )
    except NonFiniteError as exc:
        raise NonFiniteDumpError(f"dump {exc}") from exc
    except SourceError as exc:
        raise CorruptDumpError(f"dump tensors: {exc}") from exc


def _int64_bytes(values: list[int]) -> bytes:
    arr = array.array("q", values)
    if sys.byteorder != "little":
        arr.byteswap()  # safetensors is little-endian
    return arr.tobytes()


_fp8_work = threading.local()


def _fp8_sources(
    fd: int, info: TensorInfo, groups: int, stats: dict[str, float] | None
) -> tuple[Produced, Produced]:
    """The fp8 values of one dump tensor, quantized a chunk of tokens at a time from bytes
    read once into reused buffers, and their scales (filled on the way, written after)."""
    import torch

    t, d = info.shape
    item = ITEMSIZE[info.dtype]
    dtype = torch_dtype(info.dtype)
    scales = torch.empty((t, groups), dtype=torch.float32)
    rows = quant.CHUNK_TOKENS

    def buffers() -> tuple[Any, Any, Any]:
        # Per thread, grown to the widest tensor seen: [rows, D] raw, float32 and fp8.
        have = getattr(_fp8_work, "bufs", None)
        if have is None or have[1].numel() < rows * d or have[0].numel() < rows * d * item:
            have = (
                torch.empty(rows * d * max(item, 2), dtype=torch.uint8),
                torch.empty(rows * d, dtype=torch.float32),
                torch.empty(rows * d, dtype=torch.float8_e4m3fn),
            )
            _fp8_work.bufs = have
        return have

    def make() -> Iterator[memoryview]:
        raw, work, q = buffers()
        for lo in range(0, t, rows):
            hi = min(t, lo + rows)
            nbytes = (hi - lo) * d * item
            view = memoryview(raw.numpy())[:nbytes]
            t0 = time.perf_counter()
            _pread_exact(fd, view, info.start + lo * d * item)
            t1 = time.perf_counter()
            x = raw[:nbytes].view(dtype).view(hi - lo, d)
            qc = q[: (hi - lo) * d].view(hi - lo, d)
            quant.quantize_into(x, groups, qc, scales[lo:hi], work)
            if stats is not None:
                stats["read_s"] = stats.get("read_s", 0.0) + t1 - t0
                stats["quantize_s"] = stats.get("quantize_s", 0.0) + time.perf_counter() - t1
            yield memoryview(qc.view(torch.uint8).numpy()).cast("B")

    def scale_bytes() -> Iterator[memoryview]:
        yield raw_bytes(scales)

    return Produced(make, t * d), Produced(scale_bytes, 4 * t * groups)


def _checked_fp8_copy(
    fd: int, info: TensorInfo, sinfo: TensorInfo, stats: dict[str, float] | None
) -> tuple[Produced, Produced]:
    """A server-made fp8 tensor and its scales, copied from bytes read once into buffers of
    the writer's own and checked there (so the bytes checked are the bytes written): the
    scales (small, [T, groups]) when the values start, the values a chunk at a time."""
    import torch

    t, d = info.shape
    groups = sinfo.shape[1]
    scales: Any = torch.empty((t, groups), dtype=torch.float32)  # Any: .numpy() as a buffer
    rows = quant.CHUNK_TOKENS
    name = info.name

    def make() -> Iterator[memoryview]:
        _pread_exact(fd, memoryview(scales.numpy()).cast("B"), sinfo.start)
        raw: Any = torch.empty(min(t, rows) * d, dtype=torch.uint8)
        for lo in range(0, t, rows):
            hi = min(t, lo + rows)
            view = memoryview(raw.numpy())[: (hi - lo) * d]
            t0 = time.perf_counter()
            _pread_exact(fd, view, info.start + lo * d)
            t1 = time.perf_counter()
            q = raw[: (hi - lo) * d].view(torch.float8_e4m3fn).view(hi - lo, d)
            quant.check_quantized(q, scales[lo:hi], name)
            if stats is not None:
                stats["read_s"] = stats.get("read_s", 0.0) + t1 - t0
                stats["check_s"] = stats.get("check_s", 0.0) + time.perf_counter() - t1
            yield view

    def scale_bytes() -> Iterator[memoryview]:
        yield raw_bytes(scales)  # what make() read and checked

    return Produced(make, t * d), Produced(scale_bytes, sinfo.nbytes)


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    while view:
        try:
            got = os.preadv(fd, [view], offset)
        except OSError as exc:
            raise SourceError(f"cannot read the source: {exc}") from exc
        if got == 0:
            raise SourceError("source file ended early")
        view, offset = view[got:], offset + got
