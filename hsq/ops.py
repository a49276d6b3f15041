"""Operating a run: status, requeue, verify and repair, purge. The CLI only formats these.

Status partitions the dataset: every sample is counted in exactly one of done, dead,
in_progress, retry, queued or missing (in that order of precedence), so the numbers always
add up to `total`, even while workers run. `missing` is what a lost queue entry or a wiped
queue leaves behind; `requeue --missing` puts it back.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsq.dataset import IndexEntry
from hsq.keys import RUNS, RunKeys, rq_job_key
from hsq.outputs import SUFFIX, ManifestEntry, check_output
from hsq.store import RunStore, chunked

STATUS_KEYS = ("run", "total", "done", "queued", "in_progress", "retry", "dead", "workers")


def _partition(store: RunStore) -> tuple[set[str], dict[str, str], set[str], set[str], set[str]]:
    """(index ids, outstanding id -> place, done ids, dead sample ids, dead line keys)."""
    index = set(store.iter_hash_keys(store.k.index))
    outstanding = store.outstanding_samples()
    done = set(store.iter_hash_keys(store.k.done))
    dead_keys = set(store.iter_hash_keys(store.k.dead))
    dead_lines = {k for k in dead_keys if k.startswith("line:")}
    return index, outstanding, done, dead_keys - dead_lines, dead_lines


def run_status(store: RunStore, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    index, outstanding, done, dead, dead_lines = _partition(store)
    counts = Counter[str]()
    for sid in index:
        if sid in done:
            counts["done"] += 1
        elif sid in dead:
            counts["dead"] += 1
        elif sid in outstanding:
            place = outstanding[sid]
            counts["in_progress" if place.startswith("wip:") else place] += 1
        else:
            counts["missing"] += 1
    stats = store.stats()
    workers: list[dict[str, Any]] = []
    for wid in store.worker_ids():
        info = store.worker_info(wid)
        if not info:
            workers.append({"id": wid, "state": "dead (heartbeat expired)"})
            continue
        workers.append(
            {
                "id": wid,
                "name": info.get("name"),
                "server": info.get("server"),
                "state": info.get("state"),
                "last_sample": info.get("last_sample") or None,
                "done": int(info.get("done", 0)),
                "samples_per_s": float(info.get("samples_per_s", 0)),
                "tokens_per_s": float(info.get("tokens_per_s", 0)),
                "host": info.get("host"),
                "heartbeat_age_s": round(now - float(info.get("ts", now)), 1),
                "dumps_discarded": int(info.get("dumps_discarded", 0)),
            }
        )
    samples_s = sum(w.get("samples_per_s", 0.0) for w in workers)
    tokens_s = sum(w.get("tokens_per_s", 0.0) for w in workers)
    tokens_left = max(stats.get("total_tokens", 0) - stats.get("tokens", 0), 0)
    eta = tokens_left / tokens_s if tokens_s > 0 else None
    dead_entries = store.dead_entries()
    return {
        "run": store.run,
        "total": len(index) + len(dead_lines),
        "done": counts["done"],
        "queued": counts["main"],
        "in_progress": counts["in_progress"],
        "retry": counts["retry"],
        "dead": counts["dead"] + len(dead_lines),
        "missing": counts["missing"],
        "invalid_lines": len(dead_lines),
        "tokens_done": stats.get("tokens", 0),
        "tokens_total": stats.get("total_tokens", 0),
        "bytes_done": stats.get("bytes", 0),
        "samples_per_s": round(samples_s, 3),
        "tokens_per_s": round(tokens_s, 1),
        "eta_s": None if eta is None else round(eta, 1),
        "dead_by_reason": dict(Counter(e["reason"] for e in dead_entries.values())),
        "workers": workers,
    }


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
    p = store.r.pipeline(transaction=False)
    for sid, _ in todo:
        p.hdel(store.k.dead, sid)
        p.hdel(store.k.crashes, sid)
    p.execute()


@dataclass
class VerifyResult:
    checked: int = 0
    ok: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: dict[str, list[str]] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)
    requeued: int = 0

    @property
    def problems(self) -> int:
        return len(self.missing) + len(self.corrupt) + len(self.orphans)


def verify(
    store: RunStore,
    out_root: Path,
    *,
    deep: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> VerifyResult:
    res = VerifyResult()
    known: set[str] = set()
    for raw_id, raw_entry in store.r.hscan_iter(store.k.done, count=1000):
        sid = raw_id.decode()
        entry = ManifestEntry.from_json(raw_entry)
        known.add(entry.path)
        problems = check_output(out_root / entry.path, sid, entry, deep=deep)
        res.checked += 1
        if problems == ["missing"]:
            res.missing.append(sid)
        elif problems:
            res.corrupt[sid] = problems
        else:
            res.ok += 1
        if on_progress is not None:
            on_progress(1)
    if out_root.is_dir():
        for dirpath, _dirs, files in os.walk(out_root):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), out_root)
                if rel not in known and (name.endswith(SUFFIX) or name.endswith(".tmp")):
                    res.orphans.append(rel)
    res.orphans.sort()
    return res


def repair(store: RunStore, out_root: Path, res: VerifyResult) -> int:
    """Un-done missing and corrupt samples (removing a corrupt file) and requeue them."""
    bad = res.missing + list(res.corrupt)
    for sid in bad:
        entry = store.get_manifest(sid)
        if entry is None:
            continue
        if sid in res.corrupt:
            (out_root / entry.path).unlink(missing_ok=True)
        store.undo_done(sid, entry)
    rq = RequeueResult()
    requeue(store, bad, rq, dry_run=False)
    res.requeued = rq.enqueued
    return rq.enqueued


def list_runs(client: Any) -> list[str]:
    return sorted(r.decode() for r in client.smembers(RUNS))


def purge(store: RunStore) -> int:
    """Delete every Redis key of a run (outputs on disk stay). Returns keys deleted."""
    k: RunKeys = store.k
    jobs = [j for ids in store.outstanding_job_ids().values() for j in ids]
    keys = [*k.all_static()]
    for wid in store.worker_ids():
        keys += [k.worker(wid), k.wip(wid)]
    keys += [rq_job_key(j) for j in jobs]
    n = 0
    for i in range(0, len(keys), 1000):
        n += int(store.r.delete(*keys[i : i + 1000]))
    store.r.srem(RUNS, store.run)
    return n


def status_text(st: dict[str, Any]) -> list[str]:
    total = st["total"] or 1
    pct = 100.0 * st["done"] / total
    eta = "-" if st["eta_s"] is None else _dur(st["eta_s"])
    lines = [
        f"run {st['run']}: {st['done']}/{st['total']} done ({pct:.1f}%), "
        f"{st['tokens_done']:,}/{st['tokens_total']:,} tokens, "
        f"{st['bytes_done'] / 1e9:.2f} GB",
        f"  queued {st['queued']}  in progress {st['in_progress']}  retry {st['retry']}  "
        f"dead {st['dead']}  missing {st['missing']}",
        f"  rate {st['samples_per_s']:.2f} samples/s, {st['tokens_per_s']:,.0f} tokens/s, "
        f"ETA {eta}",
    ]
    if st["dead_by_reason"]:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(st["dead_by_reason"].items()))
        lines.append(f"  dead letter by reason: {reasons}")
    if st["missing"]:
        lines.append("  missing samples are in no queue: `hsq requeue --missing` puts them back")
    for w in st["workers"]:
        lines.append(
            f"  worker {w.get('name') or w['id']} [{w.get('state')}] server {w.get('server')} "
            f"last {w.get('last_sample')} done {w.get('done', 0)} "
            f"{w.get('tokens_per_s', 0):,.0f} tokens/s"
            + (f" dumps discarded {w['dumps_discarded']}" if w.get("dumps_discarded") else "")
        )
    if not st["workers"]:
        lines.append("  no live workers")
    return lines


def _dur(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def dumps_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
