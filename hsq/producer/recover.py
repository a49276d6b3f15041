"""`hsq recover`: rebuild a run's Redis state from its output files (after a Redis loss).

The enqueue pass over a list of the dataset, with one step first: every output file
already under <out>/<run>/ is checked against its dataset line and re-marked done. The
run's model and layers are decided by hsq/producer/identity.py; files of another model or
layers are reported as stale and their samples enqueued again, never marked done. Nothing
changes until the identity is decided, so a refusal (a tie, a contradiction) leaves Redis
as it was. Safe on a live run: it only adds what is missing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from hsq import logs
from hsq.dataset.jsonl import IndexEntry, scan_dataset
from hsq.dataset.read import read_sample
from hsq.errors import ConfigError, DatasetError, EmptyDatasetError
from hsq.outputs.manifest import ManifestEntry
from hsq.producer.identity import (
    Identity,
    IdentityHint,
    decide_identity,
    decide_states_dtype,
    given_conflicts,
)
from hsq.producer.identity import identity_key as _key
from hsq.producer.report import (
    Bad,
    EnqueueReport,
    dead_letter_bad,
    lock_holder,
    log,
    log_report,
    prune,
    refuse_conflicts,
)
from hsq.runconfig import DEFAULT_CHUNK_SIZE, RunConfig
from hsq.runstore import RunStore
from hsq.states import BF16
from hsq.store import chunked


@dataclass(frozen=True)
class RecoverRequest:
    """What `hsq recover` was told; `recover_config` makes the run's config of it."""

    run: str
    dataset: Path | None = None
    """Needed when the run is not in Redis; else, if given, it must be the recorded one."""
    out: Path | None = None
    """The output root (files in OUT/RUN/); as `dataset`."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    store_dtype: str | None = None
    """None: what most of the run's files say, else bf16."""
    prenorm: bool | None = None
    """None: what the run's files say."""
    hint: IdentityHint = field(default_factory=IdentityHint)


def recover_config(known: RunConfig | None, req: RecoverRequest) -> RunConfig:
    """The recorded config, if the run is in Redis (what was given must agree with it);
    else a new one from the request, its storage settings read off the files unless given."""
    if known is not None:
        given = [
            f"{name}: recorded {rec}, given {arg}"
            for name, rec, arg in (("dataset", known.dataset, req.dataset),
                                   ("out", known.out, req.out))
            if arg is not None and Path(rec) != arg.resolve()
        ]  # fmt: skip
        given += given_conflicts(known, req.hint)
        if given:
            raise ConfigError(f"run {req.run!r} exists with other settings: " + "; ".join(given))
        return known
    if req.dataset is None or req.out is None:
        raise ConfigError(f"run {req.run!r} is not in Redis: give DATASET and --out to recover it")
    from hsq.outputs.adopt import detect_prenorm, detect_store_dtype

    root = req.out.resolve()
    store_dtype = req.store_dtype or detect_store_dtype(root / req.run) or BF16
    prenorm = req.prenorm if req.prenorm is not None else bool(detect_prenorm(root / req.run))
    return RunConfig(
        run=req.run,
        dataset=str(req.dataset.resolve()),
        out=str(root),
        chunk_size=req.chunk_size,
        store_dtype=store_dtype,
        prenorm=prenorm,
    )


def recover_run(store: RunStore, req: RecoverRequest, *, progress: bool = True) -> EnqueueReport:
    """Rebuild a run's Redis state from its output directory (module docstring)."""
    cfg = recover_config(store.load_config(), req)
    cfg.validate()
    with store.lifecycle.enqueue_lock(lock_holder()):
        return _recover_locked(store, cfg, progress=progress, hint=req.hint)


def _recover_locked(
    store: RunStore,
    cfg: RunConfig,
    *,
    progress: bool,
    hint: IdentityHint,
) -> EnqueueReport:
    existing = store.load_config()
    refuse_conflicts(existing, cfg)
    report = EnqueueReport()
    valid, bad = _scan(Path(cfg.dataset), cfg.max_tokens, report, progress)
    report.valid = len(valid)
    if not valid:
        raise EmptyDatasetError()
    # Read-only until the identity is decided: a refusal changes nothing.
    plan = _plan_recovery(store, existing or cfg, valid, report, progress, hint)
    if existing is None and plan.identity is not None:
        cfg = replace(cfg, model_id=plan.identity[0], layer_ids=plan.identity[1])
    if existing is None:
        existing, _ = store.create_config(cfg)
    store.lifecycle.begin_enqueue()
    store.config_index.put_index(valid)
    store.set_totals(
        samples=len(valid), tokens=sum(e.num_tokens for _, e in valid), invalid_lines=len(bad)
    )
    dead_letter_bad(store, bad)
    report.pruned = prune(store, {sid for sid, _ in valid}, {key for key, _, _ in bad})
    _apply_recovery(store, plan, report)
    _enqueue_rest(store, valid, report, cfg.chunk_size)
    store.lifecycle.end_enqueue()
    log_report(cfg.run, report)
    return report


def _enqueue_rest(
    store: RunStore, valid: list[tuple[str, IndexEntry]], report: EnqueueReport, chunk_size: int
) -> None:
    """Enqueue every valid sample that is neither done, queued or held, nor dead."""
    dead_ids = set(store.iter_hash_keys(store.keys.dead))
    outstanding = store.outstanding_samples()
    todo: list[tuple[str, IndexEntry]] = []
    for i in range(0, len(valid), 5000):
        batch = valid[i : i + 5000]
        done = store.done_among([sid for sid, _ in batch])
        for sid, entry in batch:
            if sid in done:
                report.done += 1
            elif sid in outstanding:
                report.outstanding += 1
            elif sid in dead_ids:
                report.dead += 1
            else:
                todo.append((sid, entry))
    chunks = list(chunked(todo, chunk_size))
    report.enqueued = store.enqueue(chunks)
    report.chunks = len(chunks)


@dataclass
class RecoveryPlan:
    identity: Identity | None
    """None: no valid file and nothing given; the first fully valid dump pins it."""
    adopt: list[tuple[str, ManifestEntry]]
    states: tuple[str, int] | None = None
    """The adopted files' states dtype and hidden size, pinned as a worker pins them; None
    when the files do not say (fp8-e4m3) or nothing is adopted."""


def _plan_recovery(
    store: RunStore,
    cfg: RunConfig,
    valid: list[tuple[str, IndexEntry]],
    report: EnqueueReport,
    progress: bool,
    hint: IdentityHint,
) -> RecoveryPlan:
    """Check every file under OUT/RUN/ (read-only), decide the run's identity, and list the
    files to mark done: valid ones of that identity. The others are in report.rejected_files."""
    from hsq.outputs.adopt import adopt_output, file_identity, file_states
    from hsq.outputs.format import read_header

    out_root = Path(cfg.out) / cfg.run
    dataset = Path(cfg.dataset)
    ids = [sid for sid, _ in valid]
    already: set[str] = set()
    for i in range(0, len(ids), 5000):
        already |= store.done_among(ids[i : i + 5000])
    found: list[tuple[str, ManifestEntry, Identity, tuple[str, int] | None]] = []
    with logs.progress(len(valid), "file", "checking", enabled=progress) as bar:
        for sid, entry in valid:
            bar.update()
            if sid in already:
                continue
            try:
                sample = read_sample(dataset, sid, entry)
            except DatasetError as exc:  # the dataset changed under us: enqueue, don't trust
                report.rejected_files[sid] = str(exc)
                continue
            # The run's layout (pre-norm or not) and format: a run keeps one.
            manifest, why = adopt_output(
                out_root, sample, cfg.run, cfg.store_dtype, prenorm=cfg.prenorm
            )
            if manifest is None:
                if why != "missing":
                    report.rejected_files[sid] = why
                continue
            header = read_header(out_root / manifest.path)  # once, for identity and states
            ident = file_identity(header)
            if ident is None:
                report.rejected_files[sid] = "model_id or layer_ids missing from the header"
                continue
            found.append((sid, manifest, ident, file_states(header)))
    counts = Counter(_key(i) for _, _, i, _ in found)
    identity, how = decide_identity(cfg, hint, counts)
    ours = [s for _, _, i, s in found if i == identity]
    dtypes = Counter(s[0] for s in ours if s is not None)
    dtype, dtype_how = decide_states_dtype(cfg, dtypes, len(ours))
    report.identity = how if dtype is None else f"{how}, states {dtype_how}"
    adopt = []
    states: tuple[str, int] | None = None
    for sid, manifest, ident, st in found:
        if ident == identity and dtype is not None and st is not None and st[0] != dtype:
            # The worker's dtype pin forbids a mixed run: enqueued, not marked done.
            report.rejected_files[sid] = f"states stored as {st[0]}, the run's are {dtype}"
        elif ident == identity:
            adopt.append((sid, manifest))
            states = states or st
        else:
            report.stale += 1
            report.rejected_files[sid] = f"stale: model {ident[0]} layers {ident[1]}, " + (
                f"the run's is model {identity[0]} layers {identity[1]}"
                if identity is not None
                else "not what was given"
            )
    for sid, why in list(report.rejected_files.items())[:20]:
        log.warning("recover_rejected_file", sample=sid, why=why)
    return RecoveryPlan(identity, adopt, states if adopt else None)


def _apply_recovery(store: RunStore, plan: RecoveryPlan, report: EnqueueReport) -> None:
    if plan.identity is None:
        return
    model, layers = plan.identity
    recorded = store.config_index.pin_model(model, layers)  # HSETNX: a pin recorded meanwhile wins
    if recorded != (model, layers):
        raise ConfigError(f"the run pinned {recorded} meanwhile; nothing was marked done")
    if plan.states is not None:  # as a worker pins it, so its later dumps must agree
        dtype, hidden = plan.states
        pins = store.pin_dump_identity(model, layers, dtype, hidden)
        if (pins["dump_dtype"], pins["hidden_size"]) != (dtype, hidden):
            raise ConfigError(
                f"the run pinned dtype {pins['dump_dtype']} and hidden size "
                f"{pins['hidden_size']} meanwhile, its files hold {dtype} and {hidden}; "
                "nothing was marked done"
            )
    for sid, manifest in plan.adopt:
        if store.mark_done(sid, manifest):
            report.recovered += 1


def _scan(
    path: Path, max_tokens: int | None, report: EnqueueReport, progress: bool
) -> tuple[list[tuple[str, IndexEntry]], Bad]:
    valid: list[tuple[str, IndexEntry]] = []
    bad: Bad = []
    with logs.progress(path.stat().st_size, "B", "validating", enabled=progress) as bar:
        for item in scan_dataset(path, max_tokens):
            report.lines += 1
            if item.entry is not None and item.sample_id is not None:
                valid.append((item.sample_id, item.entry))
                bar.update(item.entry.length + 1)
            elif item.error is not None:
                bad.append((f"line:{item.line_no}", item.error, item.sample_id))
                report.invalid[item.error.reason] += 1
                if len(report.problems) < 20:
                    report.problems.append(f"line {item.line_no}: {item.error}")
    return valid, bad
