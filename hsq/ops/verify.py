"""`hsq verify` and its repair: every done sample's file checked against the run's manifest,
and the orphans no manifest entry claims."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from hsq import jsonsafe
from hsq.errors import DatasetError
from hsq.ops.requeue import RequeueResult, requeue
from hsq.outputs.check import check_output
from hsq.outputs.format import SUFFIX, output_relpath
from hsq.outputs.manifest import ManifestEntry, manifest_json, stored_entry, stored_path
from hsq.runstore import RunStore

MAX_MANIFEST_ENTRY = 64 * 1024
_COMPACT_AS_JSON_SAFE = (MAX_MANIFEST_ENTRY - 512) // 6
"""A stored form this short has JSON under MAX_MANIFEST_ENTRY (an escape is at most 6
characters, the keys and path ~300): it may skip the JSON and keep every verdict."""
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class VerifyResult:
    checked: int = 0
    ok: int = 0
    missing: list[str] = field(default_factory=list)
    consumed: int = 0
    """Done samples of a streamed run whose file was removed by design: every consumer
    group committed them (trained). Neither missing nor a problem."""
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
    """A manifest entry read from Redis (its JSON, or the done hash's stored form), type-
    checked, its path the one hsq would write for this id and resolving under out_root.
    Raises ValueError otherwise."""
    return _trusted(sample_id, raw, out_root, link=True)


def _outside(out_root: Path, rel: str) -> str:
    return f"{rel!r} resolves outside {out_root.resolve()}"


def _trusted(sample_id: str, raw: bytes | str, out_root: Path, *, link: bool) -> ManifestEntry:
    """trusted_entry; `link=False`: the caller knows the file is no symlink (or finds out
    as it opens it, O_NOFOLLOW), so its directory alone is checked (no lstat a file)."""
    if len(raw) <= _COMPACT_AS_JSON_SAFE:
        entry = stored_entry(sample_id, raw)  # the compact form: typed and its path by design
        if entry is not None:
            if not _resolves_under(out_root, entry.path, link):
                raise ValueError(_outside(out_root, entry.path))
            return entry
    raw = manifest_json(sample_id, raw)  # JSON as it is; a damaged compact form as it is
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
    if not _resolves_under(out_root, expected, link):
        raise ValueError(_outside(out_root, expected))
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
    threads: int = 1,
) -> VerifyResult:
    """Check one page of done entries (in a pool process, or inline), by `threads` threads
    of this process, each a slice of the page: the opens and reads release the GIL, so
    files not in the page cache are read several at a time (the disk gets a queue)."""
    if threads <= 1 or len(page) < 2 * threads:
        return _check_entries(out_root, page, deep, run_dtype, prenorm)
    step = -(-len(page) // threads)
    check = functools.partial(
        _check_entries, out_root, deep=deep, run_dtype=run_dtype, prenorm=prenorm
    )
    res = VerifyResult()
    slices = [page[i : i + step] for i in range(0, len(page), step)]
    # A pool a page (~1 ms to start, 2,000 files): none is kept that a fork would copy
    # without its threads.
    with ThreadPoolExecutor(threads, thread_name_prefix="hsq-verify") as pool:
        for part in pool.map(check, slices):
            _merge(res, part)  # in page order
    return res


def _check_entries(
    out_root: Path,
    page: list[tuple[str, bytes]],
    deep: bool,
    run_dtype: str | None,
    prenorm: bool = False,
) -> VerifyResult:
    """Check done entries one after another. Per file one open
    (O_NOFOLLOW), fstat, read and close, and no Path object: a symlink is found by the
    open and only then checked for where it leads, as trusted_entry checks it."""
    res = VerifyResult()
    root = str(out_root)
    for sid, raw in page:
        res.checked += 1
        try:
            entry = _trusted(sid, raw, out_root, link=False)
        except ValueError as exc:
            res.refused[sid] = str(exc)  # never acted on: an operator looks at it
            continue
        path = f"{root}/{entry.path}"
        try:
            problems = check_output(
                path, sid, entry, deep=deep, store_dtype=run_dtype, prenorm=prenorm, follow=False
            )
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            if not _resolves_under(out_root, entry.path, True):  # a symlink: where it leads
                res.refused[sid] = _outside(out_root, entry.path)
                continue
            problems = check_output(
                path, sid, entry, deep=deep, store_dtype=run_dtype, prenorm=prenorm
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
    into.consumed += part.consumed
    into.corrupt.update(part.corrupt)
    into.refused.update(part.refused)
    into.entries.update(part.entries)


def _drop_consumed(store: RunStore, part: VerifyResult) -> None:
    """A streamed run's missing files that every group committed are consumed, not lost."""
    if not part.missing:
        return
    gone = store.spool.consumed_of(part.missing)
    consumed = {sid for sid, c in zip(part.missing, gone, strict=True) if c}
    part.consumed += len(consumed)
    part.missing = [sid for sid in part.missing if sid not in consumed]
    for sid in consumed:
        part.entries.pop(sid, None)


@functools.lru_cache(maxsize=4096)
def _dir_under(root: str, head: str) -> tuple[bool, str, str]:
    """(whether `root/head` resolves under root, its real path, root's real path), once per
    verify process and directory (256 shards): resolving every file's path was most of a
    header check."""
    real_root = os.path.realpath(root)
    parent = os.path.realpath(os.path.join(root, head))
    return os.path.commonpath([real_root, parent]) == real_root, parent, real_root


def _resolves_under(out_root: Path, rel: str, link: bool = True) -> bool:
    """`out_root/rel` resolves under out_root: its directory does (cached), and the file
    itself is no symlink leading out (`link=False`: known to be no symlink, not looked at)."""
    head, _, name = rel.rpartition("/")
    under, parent, root = _dir_under(str(out_root), head)
    if not under or not link:
        return under
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
    threads: int = 1,
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
    check = functools.partial(
        _check_page, out_root, deep=deep, run_dtype=run_dtype, prenorm=prenorm, threads=threads
    )
    orphans: list[str] = []
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(n_jobs)) if n_jobs > 1 else None
        pages = _pages(store.ledger.iter_done(stored=True), VERIFY_PAGE)
        for part in _mapped(pool, n_jobs, check, pages):
            _drop_consumed(store, part)
            _merge(res, part)
            if on_progress is not None:
                on_progress(part.checked)
        unclaimed = functools.partial(_unclaimed, out_root)
        for found in _mapped(pool, n_jobs, unclaimed, _orphan_candidates(store, out_root)):
            orphans += found
    res.orphans = sorted(orphans)
    return res


def _mapped(
    pool: ProcessPoolExecutor | None, n_jobs: int, fn: Callable[[T], R], tasks: Iterable[T]
) -> Iterator[R]:
    """fn over tasks, results in order: inline, or by the pool with at most 2 * n_jobs
    tasks in flight (memory holds a few pages, never the run)."""
    if pool is None:
        yield from map(fn, tasks)
        return
    pending: deque[Future[R]] = deque()
    for task in tasks:
        pending.append(pool.submit(fn, task))
        while len(pending) >= 2 * n_jobs:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _pages(items: Iterable[tuple[str, bytes]], size: int) -> Iterable[list[tuple[str, bytes]]]:
    page: list[tuple[str, bytes]] = []
    for item in items:
        page.append(item)
        if len(page) >= size:
            yield page
            page = []
    if page:
        yield page


Candidate = tuple[str, str, bytes | None, bool]
"""An output or temp file under out_root: (its relative path, the id its name gives, that
id's raw done entry or None, whether the directory lists it as a symlink)."""


def _listing(out_root: Path) -> Iterator[tuple[str, list[tuple[str, bool]]]]:
    """os.walk(out_root)'s directories and files (symlinked directories listed, not
    entered; unreadable ones skipped), each file with whether it is a symlink, from the
    directory entry's type (scandir): no stat a file."""
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        files: list[tuple[str, bool]] = []
        try:
            listing = os.scandir(os.path.join(out_root, rel_dir))
        except OSError:
            continue
        with listing:
            for item in listing:
                try:
                    is_dir = item.is_dir()
                except OSError:
                    is_dir = False
                if not is_dir:
                    files.append((item.name, item.is_symlink()))
                elif not item.is_symlink():
                    pending.append(f"{rel_dir}/{item.name}" if rel_dir else item.name)
        yield rel_dir, files


def _orphan_candidates(store: RunStore, out_root: Path) -> Iterator[list[Candidate]]:
    """Every output and temp file under out_root with the done entry its name points at,
    one directory (a page of it) at a time: never a set of every path."""
    if not out_root.is_dir():
        return
    for rel_dir, files in _listing(out_root):
        found = [(n, link) for n, link in files if n.endswith(SUFFIX) or n.endswith(".tmp")]
        rels = {n: f"{rel_dir}/{n}" if rel_dir else n for n, _ in found}
        temps: list[Candidate] = [
            (rels[n], "", None, link) for n, link in found if not n.endswith(SUFFIX)
        ]
        if temps:
            yield temps  # temps: never claimed
        outputs = [(n, link) for n, link in found if n.endswith(SUFFIX)]
        for i in range(0, len(outputs), VERIFY_PAGE):
            part = outputs[i : i + VERIFY_PAGE]
            sids = [n[: -len(SUFFIX)] for n, _ in part]
            raws = store.ledger.done_entries(sids, stored=True)
            yield [
                (rels[n], sid, raw, link)
                for (n, link), sid, raw in zip(part, sids, raws, strict=True)
            ]


def _unclaimed(out_root: Path, candidates: list[Candidate]) -> list[str]:
    """The files no trusted done entry claims (a file is claimed when its name's id is
    done, its entry is trusted, and the entry's path is this file; in a pool process)."""
    return [
        rel
        for rel, sid, raw, link in candidates
        if raw is None or not _claims(sid, raw, out_root, rel, link)
    ]


def _claims(sid: str, raw: bytes, out_root: Path, rel: str, link: bool) -> bool:
    """_trusted(sid, raw).path == rel; a compact form without building its entry."""
    if len(raw) <= _COMPACT_AS_JSON_SAFE:
        path = stored_path(sid, raw)
        if path is not None:
            return path == rel and _resolves_under(out_root, path, link)
    try:
        return _trusted(sid, raw, out_root, link=link).path == rel
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
