"""Adopting an output file that is already on disk: `recover` and `enqueue --recover` check
it as thoroughly as a worker checked the dump it came from (header, token ids against the
dataset line, every tensor, finite states) before marking the sample done.

Nothing about the run is taken from one file (one stale file of an earlier model once
decided a whole run's identity): the storage format is the one most files have, and the
model and layers are decided over all files by the caller (hsq/producer/enqueue.py). A file
is adopted only where the worker would have written it: a regular file, not a symlink, in a
shard directory that is no symlink either (a link to a valid copy outside the output dir
was once marked done).
"""

from __future__ import annotations

import os
import stat
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hsq import jsonsafe
from hsq.dataset.jsonl import Sample
from hsq.errors import ConfigError, HsqError
from hsq.outputs.check import check_output, file_checksum
from hsq.outputs.format import SUFFIX, output_relpath
from hsq.outputs.format import read_header as read_output_header
from hsq.outputs.manifest import ManifestEntry
from hsq.quant import FP8_CODE
from hsq.states import DUMP_DTYPES, PRENORM_TENSOR
from hsq.stfile.arrays import BITS_ONLY, open_tensors
from hsq.stfile.header import Header
from hsq.stfile.integrity import all_finite


def detect_store_dtype(out_root: Path) -> str | None:
    """The storage format most output files under out_root declare (a run holds one; a
    stale file of another format must not decide it); None without files. A tie is a
    ConfigError: the caller must be told which (`--store-dtype`)."""
    from hsq.quant import store_dtype_of

    return _majority(out_root, lambda h: store_dtype_of(h.metadata), "--store-dtype")


def detect_prenorm(out_root: Path) -> bool | None:
    """Whether most output files under out_root store the pre-norm state; None without
    files, a ConfigError on a tie (`--prenorm` decides)."""
    found = _majority(
        out_root, lambda h: "yes" if PRENORM_TENSOR in h.tensors else "no", "--prenorm"
    )
    return None if found is None else found == "yes"


def _majority(out_root: Path, key: Callable[[Any], str], flag: str) -> str | None:
    """The value of `key` most readable output headers under out_root give."""
    from hsq.outputs.format import read_header

    if not out_root.is_dir():
        return None
    seen: Counter[str] = Counter()
    for dirpath, _dirs, files in os.walk(out_root):
        for name in files:
            if name.endswith(SUFFIX) and not name.startswith("."):
                try:
                    seen[key(read_header(Path(dirpath) / name))] += 1
                except (OSError, ValueError, HsqError):
                    continue
    ranked = seen.most_common()
    if not ranked:
        return None
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        raise ConfigError(f"output files under {out_root} disagree {dict(seen)}: pass {flag}")
    return ranked[0][0]


def _header(source: Path | Header) -> Header:
    return source if isinstance(source, Header) else read_output_header(source)


def file_identity(source: Path | Header) -> tuple[str, list[int]] | None:
    """(model_id, layer_ids) from an output file's header (or the file's path); None if it
    does not say."""
    meta = _header(source).metadata
    try:
        layers = jsonsafe.loads(meta.get("layer_ids", "null"))
    except ValueError:
        return None
    model = meta.get("model_id")
    if (
        not isinstance(model, str)
        or not isinstance(layers, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    ):
        return None
    return model, layers


def file_states(source: Path | Header) -> tuple[str, int] | None:
    """(dtype, hidden size) of the states an output file stores as computed (from its
    header or its path): the dtype by torch's name, as the worker pins it (RunConfig.
    dump_dtype). None for an fp8-e4m3 file, which no longer says what its states were
    computed in, or one that does not say."""
    from hsq.states import LAST_TENSOR
    from hsq.stfile.header import DTYPE_NAMES

    info = _header(source).tensors.get(LAST_TENSOR)
    if info is None or len(info.shape) != 2:
        return None
    name = DTYPE_NAMES.get(info.dtype)
    if name is None or name not in DUMP_DTYPES:
        return None
    return name, info.shape[1]


def placement_problem(out_root: Path, rel: str) -> str:
    """Why out_root/rel is not a file hsq itself would have written there ("" if it is):
    lstat, never followed, so a symlink to a valid copy elsewhere is refused."""
    path = out_root / rel
    try:
        shard = os.lstat(path.parent)
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"cannot stat: {exc.strerror}"
    if stat.S_ISLNK(shard.st_mode) or not stat.S_ISDIR(shard.st_mode):
        return f"its shard directory {path.parent.name}/ is a symlink or not a directory"
    if stat.S_ISLNK(st.st_mode):
        return f"a symlink (to {os.readlink(path)[:200]}), not a file hsq wrote"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return ""


def adopt_output(
    out_root: Path,
    sample: Sample,
    run: str,
    store_dtype: str | None = None,
    prenorm: bool = False,
) -> tuple[ManifestEntry | None, str]:
    """Check an existing output file of `sample` as `recover` does: header, every tensor,
    token ids against the dataset line (fingerprint and values), finite states; returns
    (a manifest entry with the file's checksum, "") or (None, why not)."""
    rel = output_relpath(sample.id)
    where = placement_problem(out_root, rel)
    if where:
        return None, where
    return judge_output(out_root / rel, rel, sample, run, store_dtype, prenorm)


def judge_output(
    path: Path,
    rel: str,
    sample: Sample,
    run: str,
    store_dtype: str | None = None,
    prenorm: bool = False,
    header: Header | None = None,
) -> tuple[ManifestEntry | None, str]:
    """adopt_output's checks of the file at `path` (which may be another name of it, e.g.
    /proc/self/fd/N of a descriptor a caller holds) as `sample`'s output at `rel`.
    `header`: the file's header if the caller has read it (read_output_header's), so it
    is parsed once; its size is the file's."""
    from hsq.dump.format import fingerprint

    if header is None:
        try:
            header = read_output_header(path)
        except FileNotFoundError:
            return None, "missing"
        except (OSError, ValueError) as exc:
            return None, f"unreadable header: {exc}"
    size = header.file_size
    meta = header.metadata
    if (PRENORM_TENSOR in header.tensors) != prenorm:  # a run keeps one layout
        return None, (
            f"no pre-norm state ({PRENORM_TENSOR}), which the run stores"
            if prenorm
            else f"holds the pre-norm state ({PRENORM_TENSOR}), which the run does not store"
        )
    n = len(sample.input_ids)
    wanted = {
        "sample_id": sample.id,
        "run": run,
        "num_tokens": str(n),
        "input_fingerprint": fingerprint(sample.input_ids),
    }
    for key, want in wanted.items():
        if meta.get(key) != want:
            return None, f"{key} {str(meta.get(key))[:80]!r} is not {want[:80]!r}"
    from hsq.quant import store_dtype_of

    entry = ManifestEntry(
        path=rel,
        num_tokens=n,
        bytes=size,
        checksum=file_checksum(path),
        worker="recover",
        time=time.time(),
        attempt=0,
        store_dtype=store_dtype_of(meta),
    )
    if store_dtype is not None and entry.store_dtype != store_dtype:
        return None, f"stored as {entry.store_dtype}, the run stores {store_dtype}"
    problems = _tensor_problems(path, sample)
    if not problems:  # both formats' tensor checks (fp8: scales, no NaN; bf16: finite)
        problems = "; ".join(check_output(path, sample.id, entry, deep=True, prenorm=prenorm))
    if problems:
        return None, problems
    return entry, ""


def _tensor_problems(path: Path, sample: Sample) -> str:
    """The file's ids and mask against the dataset line, and its hidden states' shapes and
    values (plain: finite; fp8's scale rules are check_output's deep check). numpy only."""
    try:
        f = open_tensors(path)
    except (OSError, ValueError) as exc:  # FormatError is a ValueError
        return f"unreadable tensors: {exc}"
    tensors = f.header.tensors
    n = len(sample.input_ids)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    for name, want, text in (
        ("input_ids", sample.input_ids, "input_ids differ from the dataset line"),
        ("loss_mask", mask, "loss_mask differs from the dataset line"),
    ):
        info = tensors.get(name)
        if info is None or info.dtype in BITS_ONLY or f.array(name).tolist() != want:
            return text
    for name in ("aux_hidden_states", "last_hidden_state"):
        info = tensors.get(name)
        if info is None or len(info.shape) != 2 or info.shape[0] != n:
            return f"{name} missing or of the wrong shape"
        if info.dtype != FP8_CODE and not all_finite(f.buf, info):
            return f"{name} holds NaN or Inf"
    return ""
