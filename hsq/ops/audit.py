"""`hsq audit`: re-extract a random subset of a run's done samples, one request at a time,
and compare with the stored states (hsq/closeness/rule.py says why and within what bound).

Where the audit's dumps go: a dump dir the audit owns for its duration, exactly as a
worker owns one. It takes the dump dir's lock (hsq/workers/lock.py), so it refuses a dump dir a
live worker holds and no worker can start on it meanwhile; it never touches a worker's dump
dir while that worker runs. Give it a server of its own (a spare GPU, or a server whose
worker is stopped); the server must run the run's model and layers (its readiness marker
and every dump's meta are checked against the run's pins) and should get no other
requests: "alone in its batch" holds because the audit sends one request at a time and
nothing else sends to that server.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from hsq.closeness.rule import States, Verdict, compare, compare_states, confirm, dump_states
from hsq.dataset.jsonl import IndexEntry, Sample
from hsq.dataset.read import read_sample
from hsq.dump.find import clear_dump_dir, remove_dump, wait_for_dump
from hsq.dump.read import read_dump
from hsq.errors import (
    CachedTokensError,
    ConfigError,
    HsqError,
    MetaMismatchError,
    WrongLengthError,
)
from hsq.ops import RequeueResult, requeue, trusted_entry
from hsq.outputs.format import open_output, output_relpath
from hsq.outputs.manifest import ManifestEntry
from hsq.runstore import RunStore
from hsq.workers.lock import DumpDirLock
from hsq.workers.readiness import await_hook, check_engine
from hsq.workers.runview import RunView
from hsq.workers.send.client import ServerClient, make_client
from hsq.workers.settings import EngineApi, ExchangeTuning
from hsq.workers.startup import check_dump_dir

log = structlog.get_logger("hsq.audit")
CONNECT_TIMEOUT_S = 10.0
SGLANG, EXCHANGE = EngineApi(), ExchangeTuning()
"""A worker's defaults: SGLang's API, its waits."""


@dataclass
class AuditReport:
    done: int = 0
    selected: int = 0
    audited: int = 0
    ok: int = 0
    mismatched: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    requeued: int = 0
    consumed: int = 0
    """Done samples of a streamed run whose file was removed by design (not audited)."""
    seed: int = 0
    worst_cosine: float = 1.0
    worst_abs_over_norm: float = 0.0

    def lines_out(self) -> list[str]:
        consumed = [f"consumed        {self.consumed} (trained, files removed)"]
        return [
            f"done samples    {self.done}",
            *(consumed if self.consumed else []),
            f"audited         {self.audited} of {self.selected} chosen (seed {self.seed})",
            f"match           {self.ok} (worst row cosine {self.worst_cosine:.5f}, "
            f"max |diff| {self.worst_abs_over_norm:.3%} of norm)",
            f"mismatched      {len(self.mismatched)}",
            f"not audited     {len(self.failed)}",
            f"requeued        {self.requeued}",
        ]


@dataclass
class _Target:
    client: ServerClient
    dump_dir: Path
    timeout_s: float
    view: RunView
    """The run as its workers see it: every audit dump is checked exactly as a worker
    checks one (the pins: model, layers, dtype, size; the run's store dtype and pre-norm
    state), with the worker's own expectations."""


def run_audit(
    store: RunStore,
    *,
    server: str,
    dump_dir: Path,
    fraction: float,
    out_root: Path,
    seed: int | None = None,
    do_requeue: bool = False,
    api: EngineApi = SGLANG,
    exchange: ExchangeTuning = EXCHANGE,
    on_progress: Callable[[int], None] = lambda _n: None,
    on_total: Callable[[int], None] = lambda _n: None,
) -> AuditReport:
    """`on_total` hears how many samples were chosen (a progress bar's total), `on_progress`
    each one as it is audited. `api` and `exchange` are what a worker of that server would
    be given: its API (the dump protocol is the same for both), the waits, the dump dir's
    checks."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError("--sample-fraction must be within (0, 1]")
    cfg = store.require_config()
    report = AuditReport(seed=secrets.randbits(32) if seed is None else seed)
    done = _with_files(store, dict(store.ledger.iter_done()), report)
    report.done = len(done)
    rng = random.Random(report.seed)
    chosen = rng.sample(sorted(done), min(len(done), math.ceil(fraction * len(done))))
    report.selected = len(chosen)
    on_total(len(chosen))
    if not chosen:
        return report
    request_timeout_s = exchange.request_timeout_s
    if check_dump_dir(dump_dir, exchange.dump_dir_force):
        dump_dir.mkdir(parents=True, mode=0o700)
    _require_reachable(server, request_timeout_s)
    lock = DumpDirLock(dump_dir)
    lock.acquire(f"hsq-audit:{socket.gethostname()}:{os.getpid()}")  # refuses a worker's
    client = make_client(
        api.engine, server, request_timeout=request_timeout_s, model=api.served_model
    )
    try:
        # Not a worker's 30 minutes for a starting checkpoint: the audit's own request
        # timeout bounds the wait for a server that answers but is not healthy yet.
        marker = await_hook(
            dump_dir,
            client.healthy,
            layer_ids=cfg.layer_ids,
            model_id=cfg.model_id,
            store_dtype=cfg.store_dtype,
            prenorm=cfg.prenorm,
            timeout_s=request_timeout_s,
            stop=threading.Event(),
        )
        if marker is not None:  # the wrong client: every request would fail or never dump
            check_engine(marker, api.engine, who="audit")
        clear_dump_dir(dump_dir)
        view = RunView.of(cfg, store.run)
        target = _Target(client, dump_dir, exchange.dump_timeout_s, view)
        index = store.config_index.get_index(chosen)
        bad: dict[str, ManifestEntry] = {}
        for sid in chosen:
            on_progress(1)
            try:
                entry = trusted_entry(sid, done[sid], out_root)
            except ValueError as exc:
                report.failed[sid] = f"manifest entry not trusted: {exc}"
                continue
            if sid not in index:
                report.failed[sid] = "not in the run's index"
                continue
            try:
                verdict = _audit_one(target, sid, index[sid], out_root)
            except MetaMismatchError as exc:
                raise ConfigError(
                    f"the audit server's dumps do not fit the run (its model, layers, "
                    f"store dtype or pre-norm state): {exc}"
                ) from exc
            except (HsqError, OSError) as exc:
                report.failed[sid] = str(exc)
                log.warning("audit_failed", sample=sid, error=str(exc))
                continue
            if not verdict.trusted:  # decides nothing: never counted, never requeued
                report.failed[sid] = f"comparison not trusted: {verdict.detail}"
                log.warning("audit_untrusted", sample=sid, detail=verdict.detail)
                continue
            report.audited += 1
            report.worst_cosine = min(report.worst_cosine, verdict.min_cosine)
            report.worst_abs_over_norm = max(report.worst_abs_over_norm, verdict.max_abs_over_norm)
            if verdict.ok:
                report.ok += 1
            else:
                report.mismatched[sid] = verdict.detail
                bad[sid] = entry
                log.error("audit_mismatch", sample=sid, detail=verdict.detail)
    finally:
        client.close()
        lock.release()
    if do_requeue and bad:
        report.requeued = _requeue(store, out_root, bad)
    return report


def _with_files(store: RunStore, done: dict[str, bytes], report: AuditReport) -> dict[str, bytes]:
    """The done samples less a streamed run's consumed ones (their files removed once
    every group committed them: nothing to compare with), counted in the report."""
    if not store.require_config().streamed:
        return done
    gone = store.spool.consumed_of(list(done))
    report.consumed = sum(gone)
    return {sid: raw for (sid, raw), g in zip(done.items(), gone, strict=True) if not g}


def _require_reachable(server: str, timeout_s: float) -> None:
    """ConfigError (exit 2) at once when nothing answers at `server` (a closed port
    once kept the audit waiting 30 minutes for a readiness marker); any HTTP answer will do here."""
    import httpx

    try:
        httpx.get(server.rstrip("/") + "/health", timeout=min(timeout_s, CONNECT_TIMEOUT_S))
    except httpx.HTTPError as exc:
        raise ConfigError(
            f"the audit server {server} cannot be reached ({type(exc).__name__}: {exc}): "
            "start it, or give the right --server"
        ) from exc


def _audit_one(t: _Target, sid: str, index_entry: IndexEntry, out_root: Path) -> Verdict:
    sample = read_sample(t.view.dataset, sid, index_entry)
    fresh, architecture = _extract(t, sid, sample)
    stored = open_output(out_root / output_relpath(sid), raw=True)
    first = compare_states(stored, sample.input_ids, fresh, architecture=architecture)
    if not first.mismatch:
        return first
    # Nothing is called a mismatch (and removed with --requeue) on one extraction alone.
    again, _ = _extract(t, sid, sample)
    second = compare_states(stored, sample.input_ids, again, architecture=architecture)
    return confirm(first, second, compare(fresh, again, architecture=architecture))


def _extract(t: _Target, sid: str, sample: Sample) -> tuple[States, str | None]:
    """The sample's states from one request sent alone, checked as a worker checks a dump."""
    n = len(sample.input_ids)
    rid = f"hsq-audit-{sid}-{secrets.token_hex(4)}"
    answer = t.client.prefill(sample.input_ids, rid)
    if answer.prompt_tokens != n:
        raise WrongLengthError(f"server counted {answer.prompt_tokens} prompt tokens, sent {n}")
    if answer.cached_tokens != 0:
        raise CachedTokensError(f"server reused {answer.cached_tokens} cached tokens")
    # Any other dump in the audit's own dump dir (warm-ups, an operator's request) is
    # removed, as a worker does.
    path = wait_for_dump(t.dump_dir, t.timeout_s, rid=rid)
    try:
        dump = read_dump(path, t.view.expected(rid, sample))
    finally:
        remove_dump(path)
    return dump_states(dump), dump.meta.model.architecture


def _requeue(store: RunStore, out_root: Path, bad: dict[str, ManifestEntry]) -> int:
    """Un-done the mismatched samples, remove their files, enqueue them afresh (as `verify
    --requeue` does for corrupt files)."""
    for sid, entry in bad.items():
        if store.undo_done(sid, entry):
            (out_root / output_relpath(sid)).unlink(missing_ok=True)
    res = RequeueResult()
    requeue(store, list(bad), res, dry_run=False)
    return res.enqueued
