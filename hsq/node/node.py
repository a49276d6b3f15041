"""`hsq run`: one node's share of a run, start to finish, safe to run again.

Redis (given, or this DIR's own: hsq/node/redis.py), the enqueue (idempotent; none
with --join), a server and a worker per GPU group (supervisor.py), the live view (view.py)
until every worker is done, then the summary and the commands to run next.

Signals: the first SIGINT (Ctrl-C) or SIGTERM stops the workers, which hand their jobs
back, then everything else (exit 130, or 143 for SIGTERM); a second one kills every child
at once. Nothing is lost either way: a job a killed worker held goes back to the queue
once its heartbeat expires (docs/reliability.md).
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import click

from hsq.errors import EXIT_OK, EXIT_PROBLEMS
from hsq.node.plan import NodePlan, server_args_for
from hsq.node.redis import JOIN_URL_FILE, DirLock, Listen, start_private_redis, state_dir
from hsq.node.stream import StreamView
from hsq.node.supervisor import Supervisor
from hsq.node.view import PairView, Screen, duration
from hsq.ops.status import RunStatus, run_status
from hsq.producer.settings import DatasetInput
from hsq.runconfig import ModelShape
from hsq.runstore import RunStore

POLL_S = 0.5


@dataclass(frozen=True)
class NodeJob:
    """What the command decided: everything `run_node` needs, nothing it must parse."""

    run: str
    out: Path
    plan: NodePlan
    redis_url: str | None
    """None: this DIR's own redis-server."""
    enqueue: Callable[[RunStore], list[str]] | None
    """None with --join: the run is there already."""
    worker_argv: Sequence[str]
    server_args: Sequence[str]
    metrics_port: int | None
    node: str = socket.gethostname().split(".")[0]
    max_restarts: int = 3
    json: bool = False
    verify: bool = False
    stay: bool = False
    """Workers without --burst: they wait for more work until stopped."""
    url_file: Path | None = None
    """The --redis-url-file given, named in the commands printed at the end."""
    listen: Listen | None = None
    """--listen: serve this DIR's Redis to other hosts too (TLS, the run's ACL user)."""


class Interrupts:
    """Counts SIGINT/SIGTERM; the first asks for a clean stop, the second for a kill."""

    def __init__(self) -> None:
        self.count = 0
        self.signum = 0

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        self.signum = self.signum or signum

    def install(self, stack: ExitStack) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old = signal.signal(sig, self)
            stack.callback(signal.signal, sig, old)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _pairs(sup: Supervisor) -> list[PairView]:
    return [
        PairView(
            p.spec.index,
            p.spec.kind,
            p.url,
            p.server_state,
            p.name,
            p.worker_rc,
            sup.stopping or p.given_up,
            p.worker_seen,
        )
        for p in sup.pairs
    ]


@dataclass
class Clock:
    """Where a `hsq run`'s time went: servers starting (until the first sample of this
    command is done, or a worker of this node works), then samples being extracted; the
    summary's rates are over the second part only."""

    t0: float
    first_work: float | None = None
    end: float | None = None

    def working(self, now: float) -> None:
        if self.first_work is None:
            self.first_work = now

    @property
    def starting_s(self) -> float:
        end = self.end if self.end is not None else time.monotonic()
        return (self.first_work if self.first_work is not None else end) - self.t0

    @property
    def working_s(self) -> float:
        end = self.end if self.end is not None else time.monotonic()
        return 0.0 if self.first_work is None else end - self.first_work


def _note_causes(st: RunStatus, ours: set[str], causes: dict[str, str]) -> None:
    """Why each worker of this node last waited, for the summary; cleared once it works."""
    for w in st.workers:
        if w.name in ours:
            text = getattr(w, "cause_text", None)
            if text:
                causes[w.name] = text
            elif w.state == "working":
                causes.pop(w.name, None)


def _supervise(
    store: RunStore,
    sup: Supervisor,
    screen: Screen,
    stop: Interrupts,
    tend: Callable[[], object],
    causes: dict[str, str],
    stream: StreamView | None = None,
    *,
    done0: int,
    t0: float,
) -> tuple[RunStatus, Clock]:
    """Until no worker of this node runs; `causes` gets why each of them last waited.
    `done0` and `t0`: the run's done count and the time before the servers and workers
    were started (a short run can be finished before this function first looks)."""
    clock = Clock(t0)
    handed_back = False
    now = idle = t0  # idle: the last look that saw no work (the work began after it)
    while True:
        if stop.count >= 2:
            screen.event("second interrupt: killing every server and worker now")
            sup.kill_all()
            break
        if stop.count == 1 and not handed_back:
            handed_back = True
            screen.event("interrupted: workers hand their jobs back and stop (again: now)")
            sup.stop_workers()
        for event in sup.poll():
            screen.event(event)
        tend()
        st = run_status(store)
        ours = {p.name for p in sup.pairs}
        _note_causes(st, ours, causes)
        now = time.monotonic()
        sup.observe({w.name: w.state for w in st.workers if w.name in ours and w.alive})
        if st.done > done0 or any(p.answered for p in sup.pairs):
            # Samples may have been done since the last look: the work began after it.
            clock.working(idle)
        else:
            idle = now
        if not sup.workers_running():
            break
        # On a terminal the stream's figures are lines of the view, redrawn with it; in a
        # log, a line of its own every so often.
        if stream is not None and (line := stream.tick(log=not screen.tty)) is not None:
            screen.event(line)
        screen.show(st, _pairs(sup), now - t0, extra=_stream_frame(stream, screen))
        time.sleep(POLL_S)
    for event in sup.poll():  # the last exits, said once
        screen.event(event)
    clock.end = time.monotonic()
    st = run_status(store)
    if st.done > done0:
        # Samples done between the last look and the workers' end (a short run can go
        # from loading to finished within one poll): they worked since that look at most.
        clock.working(idle)
    last = _stream_frame(stream, screen, fresh=True)
    screen.show(st, _pairs(sup), clock.end - t0, final=True, extra=last)
    return st, clock


def _stream_frame(stream: StreamView | None, screen: Screen, *, fresh: bool = False) -> list[str]:
    return stream.frame(fresh=fresh) if stream is not None and screen.tty else []


def _verify(store: RunStore, run_dir: Path) -> Any:
    from hsq.ops import verify

    return verify(store, run_dir, deep=True)


def _exit_code(st: RunStatus, stop: Interrupts, verified: Any) -> int:
    if stop.count:
        return stop.exit_code
    if st.dead or st.done < st.total or (verified is not None and verified.problems):
        return EXIT_PROBLEMS
    return EXIT_OK


@dataclass(frozen=True)
class NodeOutcome:
    """How a `run_node` ended: what its summary (`report_node`, `hsq demo`'s) says."""

    rc: int
    status: RunStatus
    rate: Rate
    verified: Any
    """hsq.ops.verify's result with --verify (and not interrupted), else None."""
    elapsed: float
    run_dir: Path
    url_file: Path | None
    """This DIR's Redis URL file (None: the Redis was given)."""
    interrupts: int
    """SIGINT/SIGTERM received (0: it ran to its end)."""
    causes: dict[str, str]
    """Why each worker of this node last waited (e.g. "output disk full since T")."""
    stream_summary: str | None = None
    """A streamed run's last line on its consumer groups (None: not streamed)."""
    all_failed: bool = False
    """Every worker of this node exited non-zero (then nothing is verified)."""
    files_consumed: bool = False
    """A streamed run without --keep-after-commit: its files go once committed, so there
    is nothing to export after it."""


def _summary_lines(job: NodeJob, o: NodeOutcome, auth: str) -> list[str]:
    st, rate, verified, causes = o.status, o.rate, o.verified, o.causes
    lines = [f"finished {st.done}/{st.total} done, {st.dead} dead in {duration(o.elapsed)}"]
    if rate.seconds > 0 or rate.starting_s > 0:
        lines.append(
            f"rate     {rate.samples_per_s:.2f} samples/s, {rate.tokens_per_s:,.0f} tokens/s "
            f"({rate.samples} samples, {rate.tokens:,} tokens in {seconds(rate.seconds)} "
            f"of extraction; servers starting before it: {seconds(rate.starting_s)})"
        )
    if o.all_failed:
        lines.append(
            "failed   every worker of this node exited with an error before the run was done "
            "(see the events above and their logs); nothing was verified"
        )
    if o.interrupts >= 2:
        lines.append(
            "killed: what the workers held goes back to the queue once their heartbeats "
            "expire; the same command resumes"
        )
    elif o.interrupts:
        lines.append("interrupted: the workers handed their jobs back; the same command resumes")
    elif st.done + st.dead < st.total:
        lines.append(
            f"not finished: {st.total - st.done - st.dead} samples left and no worker of this "
            "node running (see the events above); the same command resumes"
        )
    if st.done + st.dead < st.total:
        for name, text in sorted(causes.items()):  # e.g. "output disk full since T"
            lines.append(f"waiting  {name}: {text}")
    if st.dead:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(st.dead_by_reason.items()))
        lines.append(f"dead     {st.dead} ({reasons}); list them: hsq status --run {job.run}"
                     f" --failed{auth}")  # fmt: skip
    if verified is not None:
        lines.append(
            f"verified {verified.ok}/{verified.checked} outputs OK"
            + (f", {verified.problems} problems: hsq verify --run {job.run}{auth}"
               if verified.problems else "")
        )  # fmt: skip
    return lines


def seconds(s: float) -> str:
    """A span of the summary: tenths under a minute (a small run's extraction)."""
    return f"{s:.1f}s" if s < 60 else duration(s)


@dataclass(frozen=True)
class Rate:
    """The run's progress while this command's workers extracted samples: the final
    summary's rate (the status's own is the live workers' rate, 0 once they have ended).
    `seconds` starts once the servers answered, `starting_s` is the start-up before."""

    samples: int
    tokens: int
    seconds: float
    starting_s: float = 0.0

    @classmethod
    def between(
        cls, before: RunStatus, after: RunStatus, seconds: float, starting_s: float = 0.0
    ) -> Rate:
        return cls(
            after.done - before.done, after.tokens_done - before.tokens_done, seconds, starting_s
        )

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "samples_per_s": round(self.samples_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
        }


def run_node(job: NodeJob) -> NodeOutcome:
    """Redis, the enqueue, the servers and workers until they are done (or interrupted),
    then the deep verify if asked; what happened, for a summary (`report_node`)."""
    echo = click.echo
    out = job.out.resolve()
    state = state_dir(out)
    stop = Interrupts()
    t0 = time.monotonic()
    url_file: Path | None = None
    causes: dict[str, str] = {}
    tend: Callable[[], object] = lambda: None  # noqa: E731
    with ExitStack() as stack:
        stack.callback(DirLock(state).acquire().release)
        url = job.redis_url
        if url is None:
            redis = start_private_redis(state, run=job.run, listen=job.listen)
            stack.callback(redis.stop)
            url, url_file, tend = redis.url, state / "redis-url", redis.reserve.tend
            echo(f"redis    this DIR's redis-server on {redis.where} (AOF; {url_file})")
            if redis.join_url is not None:
                echo(f"join     other hosts: hsq run --join --run {job.run} --redis-url-file "
                     f"{state / JOIN_URL_FILE} --out THEIR_DIR ...")  # fmt: skip
        store = RunStore(_connect(url), job.run)
        if job.enqueue is not None:
            for line in job.enqueue(store):
                echo(f"enqueue  {line}")
        cfg = store.require_config()  # --join: the run must exist
        run_dir = Path(cfg.out) / job.run
        before = run_status(store)
        if not job.stay and before.done + before.dead >= before.total:
            # A finished run: nothing a server would do (SGLang takes minutes to start).
            echo(f"nothing to do: the run is complete ({before.done} done, {before.dead} "
                 "dead); no server started")  # fmt: skip
            verified = _verify(store, run_dir) if job.verify else None
            outcome = NodeOutcome(
                _exit_code(before, stop, verified), before, Rate(0, 0, 0.0), verified,
                time.monotonic() - t0, run_dir, url_file, 0, causes,
            )  # fmt: skip
            return outcome
        # The run's record, not this command's flags: a rerun or a --join that leaves out
        # --prenorm still starts servers that make the run's dumps.
        server_args = server_args_for(job.plan.kind, cfg, job.server_args)
        echo(f"servers  {len(job.plan.servers)} x {job.plan.kind} ({job.plan.why}), "
             f"model {job.plan.model}; logs in {state / 'logs'}")  # fmt: skip
        sup = Supervisor(
            job.plan, job.run, url, state, job.node, job.worker_argv, server_args,
            job.metrics_port, job.max_restarts, burst=not job.stay,
        )  # fmt: skip
        stop.install(stack)
        stack.callback(sup.shutdown, lambda: stop.count >= 2)
        stream = StreamView(store, cfg, run_dir) if cfg.streamed else None
        started = time.monotonic()
        sup.start()
        screen = Screen()
        st, clock = _supervise(
            store, sup, screen, stop, tend, causes, stream, done0=before.done, t0=started
        )
        if stream is not None and not stop.count:
            stream.linger(screen.event, lambda: stop.count > 0)
        stream_summary = None if stream is None else stream.summary()
        rate = Rate.between(before, st, clock.working_s, clock.starting_s)
        all_failed = sup.every_worker_failed()
        verify = job.verify and not stop.count and not all_failed
        verified = _verify(store, run_dir) if verify else None
    rc = _exit_code(st, stop, verified)
    elapsed = time.monotonic() - t0
    return NodeOutcome(
        rc, st, rate, verified, elapsed, run_dir, url_file, stop.count, causes, stream_summary,
        all_failed, cfg.streamed and not cfg.keep_after_commit,
    )  # fmt: skip


def report_node(job: NodeJob, o: NodeOutcome) -> None:
    """`hsq run`'s end: one JSON summary (--json), or the summary in words and the
    commands to run next."""
    echo = click.echo
    hint = o.url_file or job.url_file
    auth = f" --redis-url-file {hint}" if hint is not None else ""
    if job.json:
        v = o.verified
        summary = {
            "run": job.run, "exit_code": o.rc, "elapsed_s": round(o.elapsed, 1),
            "outputs": str(o.run_dir),
            "redis_url_file": None if o.url_file is None else str(o.url_file),
            "interrupted": bool(o.interrupts), "active_s": round(o.rate.seconds, 3),
            "starting_s": round(o.rate.starting_s, 3),
            "stream": o.stream_summary,
            "status": {**o.status.to_dict(), **o.rate.to_dict()},
            "verified": None if v is None else {
                "checked": v.checked, "ok": v.ok, "problems": v.problems
            },
        }  # fmt: skip
        echo(json.dumps(summary, sort_keys=True))
        return
    for line in _summary_lines(job, o, auth):
        echo(line)
    if o.stream_summary is not None:
        echo(o.stream_summary)
    echo(f"outputs  {o.run_dir}")
    echo("next")  # with OUT/.hsq/redis-url they start OUT's Redis for as long as they run
    echo(f"  hsq verify --run {job.run}{auth} --deep")
    if not o.files_consumed:  # a streamed run's trainers took the files: none to export
        echo(f"  hsq export --run {job.run}{auth} --format specforge --to EXPORT_DIR")


def serve_redis_only(out: Path) -> int:
    """`hsq run --out DIR --redis-only`: this DIR's Redis, until Ctrl-C, for `hsq verify`,
    `hsq export` and `hsq status` on a run whose `hsq run` has ended."""
    state = state_dir(out.resolve())
    stop = Interrupts()
    with ExitStack() as stack:
        stack.callback(DirLock(state).acquire().release)
        redis = start_private_redis(state)
        stack.callback(redis.stop)
        stop.install(stack)
        click.echo(f"redis    {redis.where}, URL in {state / 'redis-url'}; Ctrl-C stops it")
        while not stop.count and redis.alive():
            redis.reserve.tend()
            time.sleep(POLL_S)
    return EXIT_OK


def dataset_enqueue(
    dataset: Path, out: Path, data: DatasetInput, shape: ModelShape | None = None
) -> Callable[[RunStore], list[str]]:
    """NodeJob.enqueue for DATASET: the producer's enqueue (what `hsq enqueue` does), its
    report as the lines the node prints. `shape`: what the servers will dump (a streamed
    run's budget is refused before any server starts if the largest sample cannot fit)."""

    def enqueue(store: RunStore) -> list[str]:
        from hsq.producer.enqueue import enqueue_dataset

        report = enqueue_dataset(
            store, dataset, out, data, progress=False, echo=click.echo, shape=shape
        )
        bad = sum(report.invalid.values())
        line = (
            f"{report.enqueued} samples in {report.chunks} jobs ({report.valid} valid, "
            f"{bad} invalid lines, already: {report.done} done, {report.outstanding} queued, "
            f"{report.dead} dead)"
        )
        spool = (
            [report.spool.replace("spool budget    ", "spool budget ", 1)] if report.spool else []
        )
        return [line, *spool, *(f"invalid: {p}" for p in report.problems[:10])]

    return enqueue


def _connect(url: str) -> Any:
    from hsq.store import connect

    return connect(url)
