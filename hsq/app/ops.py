"""Operating a run: status, requeue, verify and repair, purge, recover. The CLI only formats.

Status partitions the dataset: every sample is counted in exactly one of done, dead,
in_progress, retry, queued or missing, so the numbers add up to `total` even while workers
run (done and dead entries always belong to the dataset: `enqueue` prunes the others).
`missing` is what a lost queue entry or a wiped queue leaves behind; `requeue --missing`
puts it back. The headline figures (total, done, dead, tokens, bytes) come from
`run_figures`, the same function the exporter uses.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hsq import jsonsafe
from hsq.dataset import IndexEntry
from hsq.errors import DatasetError
from hsq.outputs import SUFFIX, ManifestEntry, check_output, output_relpath
from hsq.runstore import RunStore
from hsq.store import chunked

MAX_MANIFEST_ENTRY = 64 * 1024


@dataclass(frozen=True)
class RunFigures:
    """A run's O(1) figures: what `hsq status` headlines and the exporter serves."""

    run: str
    total: int
    done: int
    dead: int
    remaining: int
    invalid_lines: int
    tokens_total: int
    tokens_done: int
    bytes_done: int
    queued_jobs: int
    retry_jobs: int
    held_jobs: int
    live_workers: int
    out: str | None


def run_figures(store: RunStore) -> RunFigures:
    snap = store.snapshot()
    # Invalid dataset lines are dead-letter entries (`line:N`) and part of `total`.
    total = snap.index + snap.dead_lines
    return RunFigures(
        run=store.run,
        total=total,
        done=snap.done,
        dead=snap.dead,
        remaining=max(total - snap.done - snap.dead, 0),
        invalid_lines=snap.dead_lines,
        tokens_total=snap.stats.get("total_tokens", 0),
        tokens_done=snap.stats.get("tokens", 0),
        bytes_done=snap.stats.get("bytes", 0),
        queued_jobs=snap.main_jobs,
        retry_jobs=snap.retry_jobs,
        held_jobs=snap.held_jobs,
        live_workers=snap.live_workers,
        out=snap.out,
    )


@dataclass(frozen=True)
class WorkerStatus:
    id: str
    state: str | None
    name: str | None = None
    server: str | None = None
    last_sample: str | None = None
    done: int = 0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    host: str | None = None
    heartbeat_age_s: float | None = None
    dumps_discarded: int = 0
    """Dumps whose rid was not in flight (warm-ups, leftovers, late ones): removed, counted."""


@dataclass(frozen=True)
class RunStatus:
    run: str
    total: int
    done: int
    queued: int
    in_progress: int
    retry: int
    dead: int
    missing: int
    invalid_lines: int
    tokens_done: int
    tokens_total: int
    bytes_done: int
    samples_per_s: float
    tokens_per_s: float
    eta_s: float | None
    dead_by_reason: dict[str, int]
    workers: list[WorkerStatus]

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON of `hsq status --json` (docs/operations.md)."""
        return asdict(self)


def _partition(store: RunStore) -> tuple[set[str], dict[str, str], set[str], set[str], set[str]]:
    """(index ids, outstanding id -> place, done ids, dead sample ids, dead line keys)."""
    index = set(store.iter_hash_keys(store.keys.index))
    outstanding = store.outstanding_samples()
    done = set(store.iter_hash_keys(store.keys.done))
    dead_keys = set(store.iter_hash_keys(store.keys.dead))
    dead_lines = {k for k in dead_keys if k.startswith("line:")}
    return index, outstanding, done, dead_keys - dead_lines, dead_lines


def _worker_status(wid: str, info: dict[str, str], now: float) -> WorkerStatus:
    if not info:
        return WorkerStatus(id=wid, state="dead (heartbeat expired)")

    def num(key: str) -> float:
        try:
            return float(info.get(key, 0))
        except ValueError:
            return 0.0

    return WorkerStatus(
        id=wid,
        state=info.get("state"),
        name=info.get("name"),
        server=info.get("server"),
        last_sample=info.get("last_sample") or None,
        done=int(num("done")),
        samples_per_s=num("samples_per_s"),
        tokens_per_s=num("tokens_per_s"),
        host=info.get("host"),
        heartbeat_age_s=round(now - float(info.get("ts", now)), 1) if "ts" in info else None,
        dumps_discarded=int(num("dumps_discarded")),
    )


def recount(store: RunStore) -> int:
    """Re-derive a run's counters (`hsq status --recount`; status does it by itself when
    they are missing, as in a run made by an older hsq, or disagree with the queues): the
    queue and dead-letter counts atomically, then the samples in no queue from a full
    partition (O(samples), the one slow path). Returns the samples found missing."""
    store.recount_queues()
    index, outstanding, done, dead, _ = _partition(store)
    missing = len(index - done - dead - set(outstanding))
    store.set_lost(missing)
    return missing


def run_status(
    store: RunStore, now: float | None = None, *, recount_first: bool = False
) -> RunStatus:
    """A run's status from O(1) counters (one MULTI) plus one read per worker.

    done and dead are the hashes' lengths (disjoint: the scripts keep them so); queued and
    retry are the samples the queues hold (counted by the scripts that move jobs); missing
    the samples a recount found in no queue, less those enqueued again since; in_progress
    the rest. Each part is capped by what is left, so the parts always add up to `total`;
    while a chunk in progress also has a sample in the retry queue, that sample counts once."""
    now = time.time() if now is None else now
    c = store.counts()
    if recount_first or not c.consistent:
        recount(store)
        c = store.counts()
    st = c.stats
    invalid = st.get("invalid_lines", 0)
    total = c.index + invalid
    remaining = max(total - c.done - c.dead, 0)
    missing = min(max(st.get("lost", 0), 0), remaining)
    retry = min(max(st.get("retry_samples", 0), 0), remaining - missing)
    queued = min(max(st.get("main_samples", 0), 0), remaining - missing - retry)
    workers = [_worker_status(wid, info, now) for wid, info in store.workers_info().items()]
    samples_s = sum(w.samples_per_s for w in workers)
    tokens_s = sum(w.tokens_per_s for w in workers)
    tokens_total, tokens_done = st.get("total_tokens", 0), st.get("tokens", 0)
    tokens_left = max(tokens_total - tokens_done, 0)
    eta = tokens_left / tokens_s if tokens_s > 0 else None
    return RunStatus(
        run=store.run,
        total=total,
        done=c.done,
        queued=queued,
        in_progress=remaining - missing - retry - queued,
        retry=retry,
        dead=c.dead,
        missing=missing,
        invalid_lines=invalid,
        tokens_done=tokens_done,
        tokens_total=tokens_total,
        bytes_done=st.get("bytes", 0),
        samples_per_s=round(samples_s, 3),
        tokens_per_s=round(tokens_s, 1),
        eta_s=None if eta is None else round(eta, 1),
        dead_by_reason=c.dead_reasons,
        workers=workers,
    )


@dataclass
class RequeueResult:
    selected: int = 0
    enqueued: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)
    unqueued: set[str] = field(default_factory=set)
    """Selected ids known to be in no queue (dead-letter entries: a requeue takes them out
    of the dead letter in the transaction that queues them; missing ones): requeue need not
    read every job to skip queued ones."""
    missing: set[str] = field(default_factory=set)
    """Selected ids that were missing (their requeue lowers the run's lost count)."""

    def skip(self, why: str, sid: str) -> None:
        self.skipped.setdefault(why, []).append(sid)


def select_for_requeue(
    store: RunStore,
    *,
    failed: bool = False,
    reason: str | None = None,
    samples: Iterable[str] = (),
    missing: bool = False,
) -> tuple[list[str], RequeueResult]:
    res = RequeueResult()
    chosen: list[str] = []
    if failed or reason:
        for key, entry in store.dead_entries().items():
            if reason and entry.get("reason") != reason:
                continue
            if key.startswith("line:"):
                res.skip("invalid dataset line: fix it and run `hsq enqueue` again", key)
                continue
            chosen.append(key)
            res.unqueued.add(key)
    chosen += list(samples)
    if missing:
        index, outstanding, done, dead, _ = _partition(store)
        res.missing = index - done - dead - set(outstanding)
        res.unqueued |= res.missing
        chosen += sorted(res.missing)
    res.selected = len(chosen)
    return list(dict.fromkeys(chosen)), res


def requeue(store: RunStore, ids: list[str], res: RequeueResult, *, dry_run: bool) -> None:
    """Enqueue the given samples afresh (attempt 0), skipping unknown, done and queued ones."""
    index = store.get_index(ids)
    done = store.done_among(ids)
    # Reading every job is O(queue); only ids that may be queued need it.
    outstanding = store.outstanding_samples() if set(ids) - res.unqueued else {}
    todo: list[tuple[str, IndexEntry]] = []
    for sid in ids:
        if sid not in index:
            res.skip("unknown sample id", sid)
        elif sid in done:
            res.skip("already done (use `hsq verify --requeue` to redo a bad file)", sid)
        elif sid in outstanding:
            res.skip("already queued or in progress", sid)
        else:
            todo.append((sid, index[sid]))
    res.enqueued = len(todo)
    if dry_run or not todo:
        return
    cfg = store.require_config()
    # One transaction per batch queues the samples and takes them out of the dead letter.
    store.enqueue(chunked(todo, cfg.chunk_size), clear_failures=True)
    store.forget_lost(sum(1 for sid, _ in todo if sid in res.missing))


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


def purge(store: RunStore) -> int:
    """Delete every Redis key of a run (outputs on disk stay). Returns keys deleted."""
    return store.purge()


def status_text(st: RunStatus) -> list[str]:
    total = st.total or 1
    pct = 100.0 * st.done / total
    eta = "-" if st.eta_s is None else _dur(st.eta_s)
    lines = [
        f"run {st.run}: {st.done}/{st.total} done ({pct:.1f}%), "
        f"{st.tokens_done:,}/{st.tokens_total:,} tokens, "
        f"{st.bytes_done / 1e9:.2f} GB",
        f"  queued {st.queued}  in progress {st.in_progress}  retry {st.retry}  "
        f"dead {st.dead}  missing {st.missing}",
        f"  rate {st.samples_per_s:.2f} samples/s, {st.tokens_per_s:,.0f} tokens/s, ETA {eta}",
    ]
    if st.dead_by_reason:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(st.dead_by_reason.items()))
        lines.append(f"  dead letter by reason: {reasons}")
    if st.missing:
        lines.append("  missing samples are in no queue: `hsq requeue --missing` puts them back")
    for w in st.workers:
        lines.append(
            f"  worker {w.name or w.id} [{w.state}] server {w.server} "
            f"last {w.last_sample} done {w.done} {w.tokens_per_s:,.0f} tokens/s"
            + (f" dumps discarded {w.dumps_discarded}" if w.dumps_discarded else "")
        )
    if not st.workers:
        lines.append("  no live workers")
    return lines


def _dur(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def dumps_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
