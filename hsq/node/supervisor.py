"""The servers and workers of one `hsq run`, as child processes of one supervisor.

Each pair is a server (`hsq serve-reference`, `hsq launch-sglang` or `hsq launch-vllm`, so
the launcher's refusals and readiness checks are the real ones) and the `hsq worker` that
owns its dump dir. Children share this process's group, so a kill of the group (a
terminal's Ctrl-C, a batch system's cancel) reaches them all, and each gets SIGTERM if this
process dies alone.

What a dead child means, as chosen here:
- a server that exits is restarted on the same port and dump dir, up to `max_restarts`
  times (an OOM or a CUDA fault mid-run is what long runs meet; its worker backs off while
  it is down and retries, nothing is dead-lettered for it); one that exits 2 (a refusal:
  wrong flags, no hook) is not, since it would refuse again. A server given up on has its
  worker stopped (the worker hands its jobs back).
- a worker is not restarted: it exits non-zero only for a cause a restart would meet
  again (configuration, a held dump dir, a bug it detected and stopped on); it is
  reported with its log and the other pairs go on.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hsq.errors import EXIT_USAGE
from hsq.node.plan import REFERENCE, SGLANG, VLLM, WORKER_API, NodePlan, ServerSpec
from hsq.node.procs import (
    ManagedProcess,
    ReferenceServer,
    free_port,
    hsq_command,
    low_port,
    worker_process,
)

SHM = Path("/dev/shm")


def dump_root() -> Path:
    """Node-local tmpfs for the dump dirs (dumps are written and read once, then removed)."""
    return SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())


def dump_dir_for(state: Path, run: str, index: int) -> Path:
    """The same DIR gets the same dump dirs on every run: a re-run after a crash clears
    what the killed one left instead of leaving it in /dev/shm."""
    tag = hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:10]
    return dump_root() / f"hsq-{run}-{tag}-{index}"


def launcher_args(plan: NodePlan, dump_dir: Path, port: int) -> list[str]:
    """`hsq launch-sglang` or `hsq launch-vllm` for one server of a GPU engine's plan (the
    launchers' own checks and readiness: hsq/engines/sglang/, hsq/engines/vllm/)."""
    command = {SGLANG: "launch-sglang", VLLM: "launch-vllm"}[plan.kind]
    return [command, "--model-path", plan.model, "--tp", str(plan.tp), "--dump-dir",
            str(dump_dir), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip


ANSWERED = frozenset({"working", "idle", "backing_off"})
"""Worker states reached only past the worker's first answer from its server."""

# What a starting server's log says it is doing, last match wins: the reference server's
# events, SGLang's and vLLM's own lines (weights, then CUDA graphs or torch.compile).
_PHASES = (
    (re.compile(r"loading_model|Load weight|Loading weights|Loading safetensors"), "loading"),
    (re.compile(r"warming_up|[Ww]arm(?:ing)? ?up"), "warming up"),
    (re.compile(r"Capture cuda graph|[Cc]ompil|cuda graph"), "compiling"),
)


def server_phase(log_tail: str) -> str | None:
    """The phase a starting server's log names last (None: it names none)."""
    best: tuple[int, str] | None = None
    for pattern, phase in _PHASES:
        for m in pattern.finditer(log_tail):
            if best is None or m.start() > best[0]:
                best = (m.start(), phase)
    return None if best is None else best[1]


def starting_text(pair: Pair, phase: str | None) -> str:
    """ "starting: loading since 12:00:03" (after a restart: "restarted (1), starting ...")."""
    since = time.strftime("%H:%M:%S", time.localtime(pair.started_at or time.time()))
    head = f"restarted ({pair.restarts}), starting" if pair.restarts else "starting"
    return f"{head}{': ' + phase if phase else ''} since {since}"


def should_restart(rc: int | None, restarts: int, max_restarts: int) -> bool:
    """A server that exited is started again unless it refused (exit 2: its flags, no hook;
    it would refuse again) or it has used its restarts."""
    return rc != EXIT_USAGE and restarts < max_restarts


@dataclass
class Pair:
    spec: ServerSpec
    dump_dir: Path
    port: int
    name: str
    server: ManagedProcess | None = None
    worker: ManagedProcess | None = None
    restarts: int = 0
    server_state: str = "starting"
    worker_rc: int | None = None
    given_up: bool = False
    started_at: float = 0.0
    """Wall clock of the server's (re)start: `starting since T`."""
    ready: bool = False
    """The server answered since its last (re)start (its worker got past its health check)."""
    answered: bool = False
    """It answered once, ever: from then on a silent server is `unreachable`, not starting."""
    worker_seen: bool = False
    """The worker's record was seen in Redis (its absence after that is not `starting`)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Supervisor:
    plan: NodePlan
    run: str
    redis_url: str
    state: Path
    node: str
    worker_argv: Sequence[str] = ()
    """Flags every `hsq worker` gets (hsq.cli.options.as_argv of the run's WorkerTuning)."""
    server_args: Sequence[str] = ()
    """Arguments after `--`: passed to every server unchanged."""
    metrics_port: int | None = None
    """Worker i serves metrics on metrics_port + i."""
    max_restarts: int = 3
    burst: bool = True
    """Workers exit once the run has nothing queued or held (else they wait for more)."""
    pairs: list[Pair] = field(default_factory=list)
    stopping: bool = False

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    def start(self) -> None:
        for spec in self.plan.servers:
            d = dump_dir_for(self.state, self.run, spec.index)
            # Left by a killed run: its dumps and its server's readiness marker (a worker
            # that saw it would start before the new server is up) go before anything starts.
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(mode=0o700)
            # SGLang derives more ports from its own (gRPC: port + 10000): a low one.
            port = low_port() if spec.kind == SGLANG else free_port()
            pair = Pair(spec, d, port, f"{self.node}-{spec.index}")
            self.pairs.append(pair)
            self._start_server(pair)
            self._start_worker(pair)

    def _start_server(self, pair: Pair) -> None:
        log = self.logs / f"server-{pair.spec.index}.log"
        if pair.spec.kind == REFERENCE:
            threads = max(1, (os.cpu_count() or 1) // len(self.plan.servers))
            args = ["--model", self.plan.model, "--no-fsync", "--threads", str(threads)]
            pair.server = ReferenceServer(
                pair.dump_dir,
                log,
                port=pair.port,
                args=[*args, *self.server_args],  # given flags last: click keeps the last
                parent_death_signal=signal.SIGTERM,
            )
        else:
            launcher = launcher_args(self.plan, pair.dump_dir, pair.port)
            argv = hsq_command(*launcher, *self.server_args)
            env = {"CUDA_VISIBLE_DEVICES": ",".join(pair.spec.gpus)}
            # Its own process group: SGLang forks schedulers and vLLM its engine cores,
            # which a stop (or a kill) of the group reaches; a terminal's Ctrl-C does not,
            # so it is stopped after its worker has handed back. If hsq dies, SIGTERM ends
            # the launcher (SGLang's, which stops SGLang; vLLM's execs vLLM itself).
            pair.server = ManagedProcess(
                argv, log, env, new_session=True, parent_death_signal=signal.SIGTERM
            )
        pair.started_at, pair.ready = time.time(), False
        pair.server_state = starting_text(pair, None)

    def _start_worker(self, pair: Pair) -> None:
        # The engine as a flag: an HSQ_ENGINE this process inherited (`hsq run`'s own, which
        # may say `reference`) must not choose the worker's client.
        extra = ["--engine", WORKER_API[pair.spec.kind], *self.worker_argv, "--name", pair.name]
        extra += ["--burst"] if self.burst else []
        if self.metrics_port is not None:
            extra += ["--metrics-port", str(self.metrics_port + pair.spec.index)]
        pair.worker = worker_process(
            self.run,
            pair.url,
            pair.dump_dir,
            self.redis_url,
            self.logs / f"worker-{pair.spec.index}.log",
            *extra,
            parent_death_signal=signal.SIGTERM,
        )

    def poll(self) -> list[str]:
        """Look at every child once; restart what the policy says; the events, in words."""
        events: list[str] = []
        for p in self.pairs:
            assert p.server is not None and p.worker is not None
            if p.worker_rc is None and not p.worker.alive():
                p.worker_rc = p.worker.proc.returncode
                if p.worker_rc != 0 and not self.stopping:
                    events.append(
                        f"worker {p.name} exited {p.worker_rc} (not restarted); its log: "
                        f"{p.worker.log_path}\n{p.worker.log_tail(5)}"
                    )
            if p.worker_rc is not None:
                continue  # its server is stopped with the rest
            if p.server.alive():
                continue
            rc = p.server.proc.returncode
            if self.stopping or p.given_up:
                continue
            if not should_restart(rc, p.restarts, self.max_restarts):
                p.given_up = True
                p.server_state = f"exited {rc}, given up"
                why = "refused to start" if rc == EXIT_USAGE else f"{p.restarts} restarts"
                events.append(
                    f"server {p.spec.index} exited {rc} ({why}); stopping its worker. "
                    f"Its log: {p.server.log_path}\n{p.server.log_tail(5)}"
                )
                p.worker.signal(signal.SIGTERM)  # hands its jobs back
                continue
            p.restarts += 1
            events.append(
                f"server {p.spec.index} exited {rc}; restarting it "
                f"({p.restarts}/{self.max_restarts}), log {p.server.log_path}"
            )
            self._start_server(p)
        return events

    def observe(self, worker_states: dict[str, str | None]) -> None:
        """The servers' states from their workers' live records (name -> state): a server
        is `starting` (with the phase its log names) until its worker got an answer from it,
        then `up`, or `unreachable` while that worker waits for it."""
        for p in self.pairs:
            if p.name in worker_states:
                p.worker_seen = True
            if p.server is None or not p.server.alive() or p.given_up:
                continue
            state = worker_states.get(p.name)
            if state in ANSWERED:
                p.ready = p.answered = True
            if not p.ready:
                p.server_state = starting_text(p, server_phase(p.server.log_tail(40)))
            else:
                p.server_state = "unreachable" if state == "server_down" else "up"

    def every_worker_failed(self) -> bool:
        """Every worker exited non-zero, none of them told to stop."""
        rcs = [p.worker_rc for p in self.pairs]
        return bool(rcs) and not self.stopping and all(rc not in (None, 0) for rc in rcs)

    def workers_running(self) -> bool:
        return any(p.worker is not None and p.worker.alive() for p in self.pairs)

    def stop_workers(self) -> None:
        """SIGTERM: each worker stops claiming and hands what it holds back."""
        self.stopping = True
        for p in self.pairs:
            if p.worker is not None:
                p.worker.signal(signal.SIGTERM)

    def kill_all(self) -> None:
        self.stopping = True
        for p in self.pairs:
            for child in (p.worker, p.server):
                if child is None:
                    continue
                if child.new_session:
                    child.signal_group(signal.SIGKILL)
                else:
                    child.signal(signal.SIGKILL)

    def shutdown(self, urgent: Callable[[], bool] = lambda: False) -> None:
        """Stop what still runs (workers first, so none sees its server vanish), then
        remove the dump dirs; once `urgent()` (a second Ctrl-C), kill what is left."""
        self.stopping = True
        workers = [p.worker for p in self.pairs if p.worker is not None]
        servers = [p.server for p in self.pairs if p.server is not None]
        for group, timeout in ((workers, 60.0), (servers, 30.0)):
            for child in group:
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while any(c.alive() for c in group) and time.monotonic() < deadline:
                if urgent():
                    break
                time.sleep(0.1)
            if any(c.alive() for c in group):
                self.kill_all()
        for child in servers:
            if child.new_session:
                child.signal_group(signal.SIGKILL)  # what outlived the launcher
            child.proc.wait(10)
        for p in self.pairs:
            shutil.rmtree(p.dump_dir, ignore_errors=True)
