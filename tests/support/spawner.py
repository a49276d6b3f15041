"""Where a ManagedProcess's child comes from: a fresh exec (subprocess.Popen), or a fork of
a zygote that has imported torch and transformers once (tests.support.zygote).

The tests install a ZygoteSpawner for their session (tests/conftest.py); the dump servers
(hsq.node.procs.DumpServer: reference, null, fake vLLM) use the installed one, and the
tests' helpers pass it for `hsq worker` and run the `hsq` commands that must be processes
through ZygoteSpawner.run (tests/helpers.py `hsq_process`; `hsq` calls the others in
process). Nothing else installs one: `hsq run`, `hsq demo` and the benchmarks
start every process fresh. HSQ_TEST_SPAWNER=fresh turns the zygote off for a test run.

A forked child is the zygote's child, not this process's: ForkedChild gives what Popen
gives (pid, poll, wait with the exit code, signals) from the status the zygote reports
when it reaps it. The chain of parent-death signals holds: this process dies, so does
the zygote (SIGKILL), so the child gets its own signal.
"""

from __future__ import annotations

import contextlib
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hsq.errors import HsqError
from hsq.node.spawn import (
    FRESH,
    ChildProcess,
    Spawner,
    SpawnRequest,
    _stderr_file,
    on_parent_death,
)

SPAWNER_ENV = "HSQ_TEST_SPAWNER"
"""`fresh`: the test session starts every server with a fresh exec (no zygote)."""
RUNTIME_ENV_PREFIXES = (
    "HSQ_",
    "SGLANG_HS_",
    "PYTEST_CURRENT_TEST",
    "TORCHINDUCTOR_CACHE_DIR",
    "TOKENIZERS_PARALLELISM",
)
"""Variables read only once a command runs: a child's environment may differ from the
zygote's in these. hsq's settings; pytest's per-test name; two that a test process sets
on itself while it runs (torch, to the default it computes, once inductor asks for its
cache dir; hsq.producer.tokenize). Any other difference (a PYTHON*, OMP_*, TORCH_* ...
that an import may have read) makes the start a fresh one, noted in the zygote's log."""
BASE_EXTRA = {"PYTHONUNBUFFERED": "1"}
"""What the zygote's environment has beyond this process's (as ManagedProcess hands it on)."""
READY_TIMEOUT = 300.0
ANSWER_TIMEOUT = 60.0


class ForkedChild:
    """A child the zygote forked, seen as Popen sees its own: the zygote sends its pid,
    then its exit code once reaped, on this child's status socket."""

    spawned_by = "zygote"

    def __init__(self, args: list[str], status: socket.socket) -> None:
        self.args = args
        self._status = status
        self._lock = threading.Lock()
        self.returncode: int | None = None
        answer = self._receive(ANSWER_TIMEOUT)
        if answer is None or "pid" not in answer:
            status.close()
            why = "no answer" if answer is None else answer.get("error", answer)
            raise HsqError(f"the zygote did not start {args[:4]}: {why}")
        self.pid: int = int(answer["pid"])

    def _receive(self, timeout: float | None) -> dict[str, Any] | None:
        if self._status.fileno() < 0:  # closed at the zygote's end, below
            raise self._lost()
        ready, _, _ = select.select([self._status], [], [], timeout)
        if not ready:
            return None
        data = self._status.recv(4096)
        if not data:
            self._status.close()
            raise self._lost()
        msg = json.loads(data)
        if not isinstance(msg, dict):
            raise HsqError(f"the zygote sent {msg!r}")
        return msg

    def _lost(self) -> HsqError:
        return HsqError(
            f"the zygote went away: the exit status of {self.args[:4]} is lost "
            f"(`{SPAWNER_ENV}=fresh` starts every server fresh)"
        )

    def _take(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                msg = self._receive(timeout)
                if msg is not None:
                    self.returncode = int(msg["returncode"])
                    self._status.close()
            return self.returncode

    def poll(self) -> int | None:
        return self._take(0)

    def wait(self, timeout: float | None = None) -> int:
        rc = self._take(timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return rc

    def send_signal(self, sig: int) -> None:
        # Unreaped, its pid is still its own (a zombie at worst): as Popen.send_signal.
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self) -> None:
        # A handle dropped unwaited: the child lives on, its exit code goes unread.
        with contextlib.suppress(AttributeError, OSError):
            self._status.close()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteSpawner:
    """Forks children of `python -m MODULE ARGS` from one zygote, started on first use.
    A request it cannot serve as a fresh start would be (another interpreter or flags, an
    environment that differs beyond RUNTIME_ENV_PREFIXES) is started fresh."""

    name = "zygote"

    def __init__(self, log_path: Path, preload: tuple[str, ...] | None = None) -> None:
        """`preload`: the modules the zygote imports; None: tests.support.zygote.PRELOAD."""
        from tests.support.zygote import PRELOAD  # here: `hsq run` imports this module too

        self.log_path = log_path
        self.preload = PRELOAD if preload is None else preload
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._base_env: dict[str, str] = {}
        self._closed = threading.Event()
        self.starts = {"zygote": 0, "fresh": 0}

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def spawn(self, req: SpawnRequest) -> ChildProcess:
        route = _module_of(req.argv)
        with self._lock:
            if route is None or self._closed.is_set():
                return self._fresh(req)
            if self._control is None:
                # This process's environment, as ManagedProcess hands it on: not the
                # first request's, whose extra variables the imports would read.
                self._start({**os.environ, **BASE_EXTRA})
            differ = _env_differences(self._base_env, req.env)
            if differ:
                self._note(f"fresh start of {req.argv[:4]}: the environment differs in {differ}")
                return self._fresh(req)
            assert self._control is not None
            module, args = route
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            request = {
                "module": module,
                "args": args,
                "env": req.env,
                "cwd": os.getcwd(),
                "umask": _umask(),
                "new_session": req.new_session,
                "pdeathsig": req.parent_death_signal,
            }
            try:
                with open(req.log_path, "ab") as log, _stderr_file(req) as err:
                    fds = [theirs.fileno(), log.fileno(), *([] if err is None else [err.fileno()])]
                    socket.send_fds(self._control, [json.dumps(request).encode()], fds)
            except OSError as exc:
                ours.close()
                raise HsqError(f"the zygote (pid {self.pid}) took no request: {exc}") from exc
            finally:
                theirs.close()
            self.starts["zygote"] += 1
        return ForkedChild(req.argv, ours)

    def run(
        self, argv: list[str], env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """`subprocess.run(argv, capture_output=True, text=True, stdin=DEVNULL, env=env,
        timeout=timeout)`, the child forked here where it can be: stdout and stderr apart,
        the exit code (-N for a signal), TimeoutExpired after killing it. The child's
        environment gains PYTHONUNBUFFERED=1 (the zygote's streams are unbuffered anyway;
        the output, captured whole, is the same)."""
        child_env = {**env, "PYTHONUNBUFFERED": "1"}
        if not self.forks(argv, child_env):
            return subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                env=dict(env),
            )
        with tempfile.TemporaryDirectory(prefix="hsq-spawn-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            child = self.spawn(SpawnRequest(argv, out, child_env, stderr_path=err))
            try:
                rc = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                raise subprocess.TimeoutExpired(
                    argv, timeout, output=_text(out), stderr=_text(err)
                ) from None
            return subprocess.CompletedProcess(argv, rc, _text(out), _text(err))

    def forks(self, argv: list[str], env: Mapping[str, str]) -> bool:
        """Whether spawn would fork `argv` with `env` here (else it starts it fresh)."""
        if _module_of(argv) is None or self._closed.is_set():
            return False
        base = self._base_env if self._control is not None else {**os.environ, **BASE_EXTRA}
        return not _env_differences(base, dict(env))

    def _note(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"tests.support.spawner: {line}\n")

    def _fresh(self, req: SpawnRequest) -> ChildProcess:
        self.starts["fresh"] += 1
        return FRESH.spawn(req)

    def _start(self, env: dict[str, str]) -> None:
        """The zygote, from a thread that lives until close(): its parent-death signal
        (SIGKILL) follows that thread, not whichever test thread asked first."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "tests.support.zygote", "--fd", str(theirs.fileno())]
        argv += ["--preload", ",".join(self.preload)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = threading.Event()
        failure: list[BaseException] = []

        def keeper() -> None:
            try:
                with open(self.log_path, "ab") as log:
                    self._proc = subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        pass_fds=[theirs.fileno()],
                        preexec_fn=on_parent_death(signal.SIGKILL),
                    )
            except BaseException as exc:
                failure.append(exc)
            finally:
                started.set()
            self._closed.wait()

        threading.Thread(target=keeper, name="hsq-zygote-parent", daemon=True).start()
        started.wait()
        theirs.close()
        if failure:
            ours.close()
            raise HsqError(f"cannot start the zygote: {failure[0]}") from failure[0]
        self._await_ready(ours)
        self._control = ours
        self._base_env = dict(env)

    def _await_ready(self, control: socket.socket) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            ready, _, _ = select.select([control], [], [], 1.0)
            if ready:
                data = control.recv(4096)
                if data and json.loads(data).get("ready"):
                    return
                break
            if self._proc.poll() is not None:
                break
        control.close()
        self._proc.kill()
        raise HsqError(f"the zygote did not come up ({self.log_path}):\n{_tail(self.log_path)}")

    def close(self) -> None:
        """The zygote ends at EOF on its control socket; its children live on (their
        handles stop them)."""
        with self._lock:
            self._closed.set()
            if self._proc is not None:
                self._note(f"closing: {self.starts}")
            if self._control is not None:
                self._control.close()
                self._control = None
            if self._proc is not None:
                try:
                    self._proc.wait(30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(5)


def _module_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """(MODULE, ARGS) of `this-python [-P] -m MODULE ARGS`; None for any other command line.
    (-P, hsq's own children: the zygote's sys.path comes from the test session, not a cwd.)"""
    if argv[1:2] == ["-P"]:
        argv = [argv[0], *argv[2:]]
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m" or argv[2].startswith("-"):
        return None
    return argv[2], argv[3:]


def _env_differences(base: dict[str, str], env: dict[str, str]) -> list[str]:
    """The variables, beyond RUNTIME_ENV_PREFIXES, in which `env` differs from `base`."""
    differ = {k for k in base.keys() | env.keys() if base.get(k) != env.get(k)}
    return sorted(k for k in differ if not k.startswith(RUNTIME_ENV_PREFIXES))


def _umask() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


def _text(path: Path) -> str:
    """A captured stream as subprocess.run(text=True) decodes it (universal newlines)."""
    data = path.read_bytes().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


_installed: Spawner | None = None


def install(spawner: Spawner | None) -> Spawner | None:
    """Make `spawner` the one ReferenceServer uses when given none; the previous one back."""
    global _installed
    previous, _installed = _installed, spawner
    return previous


def installed() -> Spawner:
    return _installed or FRESH
