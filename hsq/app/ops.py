"""Operating a run: status, requeue, verify and repair, purge, recover. The CLI only formats.

Status partitions the dataset: every sample is counted in exactly one of done, dead,
in_progress, retry, queued or missing, so the numbers add up to `total` even while workers
run (done and dead entries always belong to the dataset: `enqueue` prunes the others).
`missing` is what a lost queue entry or a wiped queue leaves behind; `requeue --missing`
puts it back. The headline figures (total, done, dead, tokens, bytes) come from
`run_figures`, the same function the exporter uses.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hsq import jsonsafe
from hsq.dataset import IndexEntry
from hsq.errors import DatasetError
from hsq.outputs import SUFFIX, ManifestEntry, check_output, output_relpath
from hsq.store import RunStore, chunked

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


def _worker_status(store: RunStore, wid: str, now: float) -> WorkerStatus:
    info = store.worker_info(wid)
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


def run_status(store: RunStore, now: float | None = None) -> RunStatus:
    now = time.time() if now is None else now
    index, outstanding, done, dead, _ = _partition(store)
    fig = run_figures(store)
    # done and dead come from the same reads as the places below, not from `fig` (read a
    # moment later): during a live run a sample marked done in between would otherwise
    # count twice, and the numbers must always add up to `total`.
    done_n = len(index & done)
    dead_n = len((index - done) & dead) + fig.invalid_lines
    places = Counter[str]()
    for sid in index - done - dead:
        place = outstanding.get(sid, "missing")
        places["in_progress" if place.startswith("wip:") else place] += 1
    workers = [_worker_status(store, wid, now) for wid in store.worker_ids()]
    samples_s = sum(w.samples_per_s for w in workers)
    tokens_s = sum(w.tokens_per_s for w in workers)
    tokens_left = max(fig.tokens_total - fig.tokens_done, 0)
    eta = tokens_left / tokens_s if tokens_s > 0 else None
    return RunStatus(
        run=store.run,
        total=len(index) + fig.invalid_lines,
        done=done_n,
        queued=places["main"],
        in_progress=places["in_progress"],
        retry=places["retry"],
        dead=dead_n,
        missing=places["missing"],
        invalid_lines=fig.invalid_lines,
        tokens_done=fig.tokens_done,
        tokens_total=fig.tokens_total,
        bytes_done=fig.bytes_done,
        samples_per_s=round(samples_s, 3),
        tokens_per_s=round(tokens_s, 1),
        eta_s=None if eta is None else round(eta, 1),
        dead_by_reason=dict(Counter(str(e["reason"]) for e in store.dead_entries().values())),
        workers=workers,
    )


@dataclass
class RequeueResult:
    selected: int = 0
    enqueued: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)

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
    chosen += list(samples)
    if missing:
        index, outstanding, done, dead, _ = _partition(store)
        chosen += sorted(index - done - dead - set(outstanding))
    res.selected = len(chosen)
    return list(dict.fromkeys(chosen)), res


def requeue(store: RunStore, ids: list[str], res: RequeueResult, *, dry_run: bool) -> None:
    """Enqueue the given samples afresh (attempt 0), skipping unknown, done and queued ones."""
    index = store.get_index(ids)
    done = store.done_among(ids)
    outstanding = store.outstanding_samples()
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
    # Enqueue first, then clear the dead-letter entry: a crash in between leaves a sample
    # both queued and dead (harmless), never neither.
    store.enqueue(chunked(todo, cfg.chunk_size))
    store.clear_failures(sid for sid, _ in todo)


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
    root = out_root.resolve()
    if not (root / expected).resolve().is_relative_to(root):
        raise ValueError(f"{expected!r} resolves outside {root}")
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


def verify(
    store: RunStore,
    out_root: Path,
    *,
    deep: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> VerifyResult:
    res = VerifyResult()
    known: set[str] = set()
    cfg = store.load_config()
    run_dtype = cfg.store_dtype if cfg is not None else None  # one storage format per run
    for sid, raw in store.iter_done():
        res.checked += 1
        if on_progress is not None:
            on_progress(1)
        try:
            entry = trusted_entry(sid, raw, out_root)
        except ValueError as exc:
            res.refused[sid] = str(exc)  # never acted on: an operator looks at it
            continue
        known.add(entry.path)
        problems = check_output(out_root / entry.path, sid, entry, deep=deep, store_dtype=run_dtype)
        if problems == ["missing"]:
            res.missing.append(sid)
            res.entries[sid] = entry
        elif problems:
            res.corrupt[sid] = problems
            res.entries[sid] = entry
        else:
            res.ok += 1
    if out_root.is_dir():
        for dirpath, _dirs, files in os.walk(out_root):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), out_root)
                if rel not in known and (name.endswith(SUFFIX) or name.endswith(".tmp")):
                    res.orphans.append(rel)
    res.orphans.sort()
    return res


def repair(store: RunStore, out_root: Path, res: VerifyResult) -> int:
    """Un-done missing and corrupt samples (removing a corrupt file) and requeue them. Acts
    only on entries `verify` checked (trusted_entry): never on a path from Redis as such."""
    bad = res.missing + list(res.corrupt)
    for sid in bad:
        entry = res.entries[sid]
        if sid in res.corrupt:
            (out_root / output_relpath(sid)).unlink(missing_ok=True)
        store.undo_done(sid, entry)
    outcome = RequeueResult()
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
