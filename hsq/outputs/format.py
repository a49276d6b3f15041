"""The output format: one safetensors file per sample, and its one reader.

    <out>/<run>/<shard>/<sample_id>.safetensors     shard = first 2 hex of sha256(id)

Tensors: input_ids int64 [T], loss_mask int64 [T], aux_hidden_states [T, k*H],
last_hidden_state [T, H] (post-norm), and in runs enqueued with --prenorm
last_hidden_state_prenorm [T, H] (the final layer before the norm); with the run's store
dtype fp8-e4m3 the states are float8_e4m3fn plus float32 `*_scale` tensors (hsq/quant.py).
Metadata: format, sample_id, run, layer_ids, layer_convention, model_id, num_tokens,
input_fingerprint, store_dtype.

hsq.data and `hsq export` read only through :func:`open_output`, so a new storage format
is decoded here (with hsq.quant) and nowhere else. Writing: hsq.outputs.transcode.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsq import jsonsafe, quant
from hsq.dataset.jsonl import Sample, check_sample_id
from hsq.dump.format import LAYER_CONVENTION
from hsq.errors import OutputError
from hsq.runconfig import check_store_dtype
from hsq.states import AUX_TENSOR, LAST_TENSOR, PRENORM_TENSOR, SCALE_SUFFIX
from hsq.stfile.header import ITEMSIZE, FastHeader, Header, map_file, torch_dtype
from hsq.stfile.header import read_header as read_fd_header

if TYPE_CHECKING:
    from hsq.dump.format import DumpMeta

# torch and safetensors are imported inside the functions that need them, so operator
# commands (status, requeue, verify without --deep) start in a fraction of a second.

OUTPUT_FORMAT = "hsq-eagle3-v1"
SUFFIX = ".safetensors"
IDS_TENSOR, MASK_TENSOR = "input_ids", "loss_mask"
REQUIRED_TENSORS = (IDS_TENSOR, MASK_TENSOR, AUX_TENSOR, LAST_TENSOR)
_STATES = (AUX_TENSOR, LAST_TENSOR, PRENORM_TENSOR)
OUTPUT_HEADER = FastHeader(
    (IDS_TENSOR, MASK_TENSOR, *_STATES, *(name + SCALE_SUFFIX for name in _STATES))
)
"""The compiled decoder of an output file's header (every tensor an output may hold); a
header with any other tensor goes to the strict parser."""


def output_relpath(sample_id: str) -> str:
    sid = check_sample_id(sample_id)  # never trust an id as a path, even from Redis
    shard = hashlib.sha256(sid.encode()).hexdigest()[:2]
    return f"{shard}/{sid}{SUFFIX}"


def output_metadata(sample: Sample, meta: DumpMeta, run: str, store_dtype: str) -> dict[str, str]:
    """The metadata of a sample's output file, written from its dump."""
    return {
        "format": OUTPUT_FORMAT,
        "sample_id": sample.id,
        "run": run,
        "layer_ids": json.dumps(meta.layer_ids),
        "layer_convention": LAYER_CONVENTION,
        "model_id": meta.model.model_id,
        "num_tokens": str(len(sample.input_ids)),
        "input_fingerprint": meta.input_fingerprint,
        quant.META_KEY: check_store_dtype(store_dtype),
    }


def read_header(path: Path) -> Header:
    """The safetensors header of a file: cheap enough for 100k files."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_fd_header(fd, fast=OUTPUT_HEADER)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class OutputSample:
    """One output file's tensors, mapped from the file (not copied) and metadata."""

    sample_id: str
    input_ids: Any
    """torch.int64 [T]"""
    loss_mask: Any
    """torch.int64 [T]"""
    aux_hidden_states: Any
    """[T, k*H], the aux layers concatenated in `layer_ids` order"""
    last_hidden_state: Any
    """[T, H], after the model's final norm"""
    layer_ids: list[int]
    metadata: dict[str, str]
    scales: dict[str, Any] = field(default_factory=dict)
    """Only with open_output(raw=True) on an fp8 file: `<name>_scale` float32 tensors
    ([T, k] for aux, [T, 1] for last); the hidden states are then the stored fp8 values."""
    last_hidden_state_prenorm: Any = None
    """[T, H], the final layer *before* the model's final norm; None unless the run was
    enqueued with --prenorm (vLLM speculators trains on it)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def open_output(path: Path, *, raw: bool = False) -> OutputSample:
    """Map one output file and check its structure; raises OutputError if it is not one.

    The tensors are views of a private (copy-on-write) mapping: nothing is read until it
    is touched, and nothing is ever written back. Never unpickles. An fp8 file's states
    are dequantized to bf16 (a copy); `raw=True` hands back the stored fp8 values and
    their scales instead.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise OutputError(f"cannot open {path}: {exc.strerror}") from exc
    return open_output_fd(fd, path, raw)


def open_output_under(run_dir: Path, sample_id: str, *, raw: bool = False) -> OutputSample:
    """open_output of a sample's file under `run_dir`, following no link on the way: the
    shard directory and the file are opened relative to `run_dir` with O_NOFOLLOW, so a
    path an untrusted stream names cannot lead outside the run's output directory."""
    relpath = output_relpath(sample_id)
    shard, name = relpath.split("/")
    path = run_dir / relpath
    try:
        fd = open_beneath(run_dir, shard, name, os.O_RDONLY)
    except OSError as exc:
        raise OutputError(f"cannot open {path}: {exc.strerror}") from exc
    return open_output_fd(fd, path, raw)


def remove_output(run_dir: Path, sample_id: str) -> bool:
    """Remove a sample's file under `run_dir` without following a link (the shard
    directory is opened with O_NOFOLLOW; unlink never follows the last component). False
    if there was none."""
    shard, name = output_relpath(sample_id).split("/")
    try:
        dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        sfd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)
    try:
        os.unlink(name, dir_fd=sfd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(sfd)


def open_beneath(run_dir: Path, shard: str, name: str, flags: int) -> int:
    """A descriptor of run_dir/shard/name, no link followed past run_dir; a regular file."""
    dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sfd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=sfd)
    finally:
        os.close(sfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def open_output_fd(
    fd: int, path: Path, raw: bool, mapping: mmap.mmap | None = None
) -> OutputSample:
    """open_output's work on an open descriptor (closed here); `mapping`: the descriptor's
    file mapped already (read_checked's, whose bytes it checksummed)."""
    import torch

    try:
        header = read_fd_header(fd)
        mm = mapping if mapping is not None else map_file(fd) if header.file_size else None
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: not a readable output file: {exc}") from exc
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor
    meta = header.metadata
    if meta.get("format") != OUTPUT_FORMAT:
        raise OutputError(f"{path}: format {meta.get('format')!r}, expected {OUTPUT_FORMAT!r}")
    tensors: dict[str, Any] = {}  # every stored tensor, as stored
    for name, info in header.tensors.items():
        try:
            dtype = torch_dtype(info.dtype)
        except ValueError:
            raise OutputError(f"{path}: tensor {name!r} has unknown dtype {info.dtype}") from None
        count = info.nbytes // ITEMSIZE[info.dtype]
        flat = (
            torch.frombuffer(mm, dtype=dtype, count=count, offset=info.start)
            if count and mm is not None
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.view(info.shape)
    # The storage format (fp8 values and their scales) decoded into the logical tensors.
    tensors = quant.logical_tensors(tensors, meta, raw=raw)
    scales = {n: tensors.pop(n) for n in list(tensors) if n.endswith(SCALE_SUFFIX)}
    missing = [n for n in REQUIRED_TENSORS if n not in tensors]
    if missing:
        raise OutputError(f"{path}: missing tensors {missing}")
    ids, mask = tensors[IDS_TENSOR], tensors[MASK_TENSOR]
    aux, last = tensors[AUX_TENSOR], tensors[LAST_TENSOR]
    prenorm = tensors.get(PRENORM_TENSOR)
    n = ids.shape[0] if ids.dim() == 1 else -1
    if (
        ids.dtype != torch.int64
        or mask.dtype != torch.int64
        or list(mask.shape) != [n]
        or aux.dim() != 2
        or last.dim() != 2
        or aux.shape[0] != n
        or last.shape[0] != n
        or aux.shape[1] % max(last.shape[1], 1) != 0
        or (prenorm is not None and list(prenorm.shape) != list(last.shape))
    ):
        raise OutputError(
            f"{path}: inconsistent shapes: input_ids {list(ids.shape)}, loss_mask "
            f"{list(mask.shape)}, {AUX_TENSOR} {list(aux.shape)}, {LAST_TENSOR} {list(last.shape)}"
        )
    try:
        layer_ids = [int(x) for x in jsonsafe.loads(meta.get("layer_ids", "[]"))]
    except (ValueError, TypeError) as exc:
        raise OutputError(f"{path}: bad layer_ids metadata") from exc
    return OutputSample(
        sample_id=meta.get("sample_id", ""),
        input_ids=ids,
        loss_mask=mask,
        aux_hidden_states=aux,
        last_hidden_state=last,
        layer_ids=layer_ids,
        metadata=dict(meta),
        scales=scales,
        last_hidden_state_prenorm=prenorm,
    )
