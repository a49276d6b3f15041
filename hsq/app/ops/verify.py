"""`hsq verify` and its repair: every done sample's file checked against the run's manifest,
and the orphans no manifest entry claims."""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hsq import jsonsafe
from hsq.app.ops.requeue import RequeueResult, requeue
from hsq.errors import DatasetError
from hsq.outputs.check import check_output
from hsq.outputs.format import SUFFIX, output_relpath
from hsq.outputs.manifest import ManifestEntry
from hsq.runstore import RunStore

MAX_MANIFEST_ENTRY = 64 * 1024


@dataclass
class VerifyResult:
    checked: int = 0
    ok: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: dict[str, list[str]] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    """Manifest entries hsq will not act on (not ours, or a path outside the output dir)."""
    requeued: int = 0
    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    """The checked entries of missing and corrupt samples (what repair acts on)."""

    @property
    def problems(self) -> int:
        return len(self.missing) + len(self.corrupt) + len(self.orphans) + len(self.refused)


def trusted_entry(sample_id: str, raw: bytes | str, out_root: Path) -> ManifestEntry:
    """A manifest entry read from Redis, type-checked, its path the one hsq would write for
    this id and resolving under out_root. Raises ValueError otherwise."""
    if len(raw) > MAX_MANIFEST_ENTRY:
        raise ValueError("manifest entry too large")
    obj = jsonsafe.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("manifest entry is not an object")
    types = {"path": str, "num_tokens": int, "bytes": int, "checksum": str, "worker": str}
    for name, kind in types.items():
        if type(obj.get(name)) is not kind:
            raise ValueError(f"manifest `{name}` is not a {kind.__name__}")
    try:
        expected = output_relpath(sample_id)
    except DatasetError as exc:
        raise ValueError(str(exc)) from exc
    if obj["path"] != expected:
        raise ValueError(f"manifest path {obj['path'][:200]!r} is not {expected!r}")
    if not _resolves_under(out_root, expected):
        raise ValueError(f"{expected!r} resolves outside {out_root.resolve()}")
    try:
        return ManifestEntry(
            path=obj["path"],
            num_tokens=obj["num_tokens"],
            bytes=obj["bytes"],
            checksum=obj["checksum"],
            worker=obj["worker"],
            time=float(obj.get("time", 0)),
            attempt=int(obj.get("attempt", 0)),
            store_dtype=str(obj.get("store_dtype", "bf16")),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"manifest entry malformed: {exc}") from exc


VERIFY_PAGE = 2000
"""Done entries a verify process checks per task (and manifest entries read per HSCAN)."""
PARALLEL_FROM = 20000
"""Below this many done samples verify checks in its own process (no pool to start)."""


def _check_page(
    out_root: Path,
    page: list[tuple[str, bytes]],
    deep: bool,
    run_dtype: str | None,
    prenorm: bool = False,
) -> VerifyResult:
    """Check one page of done entries (in a pool process, or inline)."""
    res = VerifyResult()
    for sid, raw in page:
        res.checked += 1
        try:
            entry = trusted_entry(sid, raw, out_root)
        except ValueError as exc:
            res.refused[sid] = str(exc)  # never acted on: an operator looks at it
            continue
        problems = check_output(
            out_root / entry.path, sid, entry, deep=deep, store_dtype=run_dtype, prenorm=prenorm
        )
        if problems == ["missing"]:
            res.missing.append(sid)
            res.entries[sid] = entry
        elif problems:
            res.corrupt[sid] = problems
            res.entries[sid] = entry
        else:
            res.ok += 1
    return res


def _merge(into: VerifyResult, part: VerifyResult) -> None:
    into.checked += part.checked
    into.ok += part.ok
    into.missing += part.missing
    into.corrupt.update(part.corrupt)
    into.refused.update(part.refused)
    into.entries.update(part.entries)


@functools.lru_cache(maxsize=4096)
def _resolved(path: str) -> str:
    """A directory's real path, once per verify process (256 shard directories): resolving
    every file's full path was most of a header check."""
    return os.path.realpath(path)


def _resolves_under(out_root: Path, rel: str) -> bool:
    """`out_root/rel` resolves under out_root: its directory does (cached), and the file
    itself is no symlink leading out."""
    root = _resolved(str(out_root))
    head, _, name = rel.rpartition("/")
    parent = _resolved(os.path.join(str(out_root), head))
    if os.path.commonpath([root, parent]) != root:
        return False
    path = os.path.join(parent, name)
    if os.path.islink(path):
        return Path(path).resolve().is_relative_to(root)
    return True


def verify(
    store: RunStore,
    out_root: Path,
    *,
    deep: bool = False,
    on_progress: Callable[[int], None] | None = None,
    jobs: int | None = None,
) -> VerifyResult:
    """Check every done sample's file, then list orphans (files no done entry claims).

    Memory stays bounded whatever the run's size: done entries are read a page at a time
    (HSCAN) and checked by `jobs` processes (default: the CPUs, for runs of PARALLEL_FROM
    samples or more), a few pages in flight; orphans are found one directory at a time by
    asking the done hash about that directory's files, never by a set of every path."""
    res = VerifyResult()
    cfg = store.load_config()
    run_dtype = cfg.store_dtype if cfg is not None else None  # one storage format per run
    prenorm = cfg.prenorm if cfg is not None else False
    n_jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if n_jobs > 1 and store.count(store.keys.done) < PARALLEL_FROM and jobs is None:
        n_jobs = 1
    pages = _pages(store.iter_done(), VERIFY_PAGE)
    if n_jobs <= 1:
        for page in pages:
            _merge(res, _check_page(out_root, page, deep, run_dtype, prenorm))
            if on_progress is not None:
                on_progress(len(page))
    else:
        with ProcessPoolExecutor(n_jobs) as pool:
            pending: deque[Future[VerifyResult]] = deque()
            for page in pages:
                pending.append(pool.submit(_check_page, out_root, page, deep, run_dtype, prenorm))
                while len(pending) >= 2 * n_jobs:
                    _take(res, pending.popleft(), on_progress)
            while pending:
                _take(res, pending.popleft(), on_progress)
    res.orphans = sorted(_orphans(store, out_root))
    return res


def _take(
    res: VerifyResult, fut: Future[VerifyResult], on_progress: Callable[[int], None] | None
) -> None:
    part = fut.result()
    _merge(res, part)
    if on_progress is not None:
        on_progress(part.checked)


def _pages(items: Iterable[tuple[str, bytes]], size: int) -> Iterable[list[tuple[str, bytes]]]:
    page: list[tuple[str, bytes]] = []
    for item in items:
        page.append(item)
        if len(page) >= size:
            yield page
            page = []
    if page:
        yield page


def _orphans(store: RunStore, out_root: Path) -> Iterable[str]:
    """Output and temp files under out_root that no trusted done entry claims, one
    directory at a time (a file is claimed when its name's id is done, its entry is
    trusted, and the entry's path is this file)."""
    if not out_root.is_dir():
        return
    for dirpath, _dirs, files in os.walk(out_root):
        names = [n for n in files if n.endswith(SUFFIX) or n.endswith(".tmp")]
        rels = {n: os.path.relpath(os.path.join(dirpath, n), out_root) for n in names}
        outputs = [n for n in names if n.endswith(SUFFIX)]
        yield from (rels[n] for n in names if not n.endswith(SUFFIX))  # temps: never claimed
        for i in range(0, len(outputs), VERIFY_PAGE):
            part = outputs[i : i + VERIFY_PAGE]
            sids = [n[: -len(SUFFIX)] for n in part]
            for name, sid, raw in zip(part, sids, store.done_entries(sids), strict=True):
                if raw is None or not _claims(sid, raw, out_root, rels[name]):
                    yield rels[name]


def _claims(sid: str, raw: bytes, out_root: Path, rel: str) -> bool:
    try:
        return trusted_entry(sid, raw, out_root).path == rel
    except ValueError:
        return False


def repair(store: RunStore, out_root: Path, res: VerifyResult) -> int:
    """Un-done missing and corrupt samples (removing a corrupt file) and requeue them. Acts
    only on entries `verify` checked (trusted_entry): never on a path from Redis as such."""
    bad = res.missing + list(res.corrupt)
    for sid in bad:
        entry = res.entries[sid]
        if sid in res.corrupt:
            (out_root / output_relpath(sid)).unlink(missing_ok=True)
        store.undo_done(sid, entry)
    outcome = RequeueResult(unqueued=set(bad))  # they were done until just now
    requeue(store, bad, outcome, dry_run=False)
    res.requeued = outcome.enqueued
    return outcome.enqueued
