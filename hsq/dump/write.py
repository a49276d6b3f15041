"""The one writer of dumps: every server (the reference server, the SGLang hook, the test
servers) writes its dumps with :func:`write_dump`, so the layout has one implementation."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hsq import fsio
from hsq.dump.format import DONE_FILE, DUMP_PREFIX, META_FILE, TENSOR_FILE, TMP_SUFFIX, DumpMeta
from hsq.stfile.engine import write_from_memory
from hsq.stfile.header import build_header, dtype_code, tensor_bytes

if TYPE_CHECKING:
    import torch


def write_dump(
    dump_dir: Path,
    index: int,
    meta: DumpMeta,
    tensors: Mapping[str, torch.Tensor],
    *,
    mark_done: bool = True,
    fsync: bool = True,
    before_done: Callable[[Path], None] | None = None,
) -> Path:
    """Write one dump atomically: req_<N>.tmp/ -> files -> done -> rename to req_<N>/.

    ``mark_done=False`` leaves a dump without its marker and ``before_done`` may alter the
    files first: both exist for fault injection, so readers are tested against them.
    """
    tmp = dump_dir / f"{DUMP_PREFIX}{index}{TMP_SUFFIX}"
    final = dump_dir / f"{DUMP_PREFIX}{index}"
    tmp.mkdir(parents=False, exist_ok=False)
    entries = [
        (k, dtype_code(v.dtype), list(v.shape), v.numel() * v.element_size())
        for k, v in tensors.items()
    ]
    fd = os.open(tmp / TENSOR_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # From the tensors' memory: no extra copy, and the GIL stays free for the forward
        # pass that shares this process. Through the page cache: the worker reads it at once.
        header = build_header(entries, None)
        write_from_memory(fd, header, [tensor_bytes(v) for v in tensors.values()])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    fsio.write_small(tmp / META_FILE, meta.to_json().encode(), fsync=fsync)
    if before_done is not None:
        before_done(tmp)
    if mark_done:
        fsio.write_small(tmp / DONE_FILE, b"", fsync=fsync)
    if fsync:
        fsio.fsync_path(tmp)
    fsio.rename_durably(tmp, final, fsync=fsync)
    return final


_INDEX_RE = re.compile(r"^req_(\d+)(?:\.tmp)?$")


def first_free_index(dump_dir: Path) -> int:
    """Past every req_<N> already there, so a restarted server never collides (the SGLang
    hook's and the vLLM connector's writers both number their dumps from it)."""
    top = -1
    with os.scandir(dump_dir) as it:
        for entry in it:
            m = _INDEX_RE.match(entry.name)
            if m:
                top = max(top, int(m.group(1)))
    return top + 1
