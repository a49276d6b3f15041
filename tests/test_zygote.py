"""The zygote (tests.support.zygote, tests.support.spawner): a forked child is the process a
fresh exec would give, and its handle gives what Popen gives.

Real processes throughout: tests/zygote_probe.py reports what it inherited, exits as told
or sleeps until signalled. "full" is a zygote that has imported torch and transformers
(the session's, as the reference servers get it); "light" one that has imported nothing
heavy, for the handle's semantics, each test its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsq.errors import HsqError
from hsq.node.procs import ManagedProcess, worker_process
from hsq.node.spawn import FRESH, Spawner
from hsq.producer.synthetic import write_synthetic
from tests.helpers import children, enqueue, log_events, state, store, wait_until
from tests.support.procs import NullServer
from tests.support.spawner import ZygoteSpawner

TESTS = Path(__file__).resolve().parent
INHERITED = (
    "argv",
    "orig_argv",
    "executable",
    "main_file",
    "name",
    "path0",
    "cwd",
    "env",
    "umask",
    "fds",
    "std",
    "signals",
    "blocked",
    "threads",
    "pdeathsig",
    "session_leader",
    "group_leader",
)
"""What a forked child must have exactly as a fresh one has it."""


@pytest.fixture(scope="module")
def full(zygote: Spawner, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteSpawner]:
    """The session's zygote, or this file's own where the session runs fresh."""
    if isinstance(zygote, ZygoteSpawner):
        yield zygote
        return
    own = ZygoteSpawner(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield own
    own.close()


@pytest.fixture
def light(tmp_path: Path) -> Iterator[ZygoteSpawner]:
    z = ZygoteSpawner(tmp_path / "zygote.log", preload=("json",))
    yield z
    z.close()


@pytest.fixture(autouse=True)
def in_tests_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m zygote_probe` finds the probe in its working directory, tests/."""
    monkeypatch.chdir(TESTS)


def probe(spawner: Spawner, log: Path, *args: str, **kw: Any) -> ManagedProcess:
    argv = [sys.executable, "-m", "zygote_probe", *args]
    return ManagedProcess(argv, log, env={"HSQ_PROBE": "1"}, spawner=spawner, **kw)


def probe_state(spawner: Spawner, tmp_path: Path, **kw: Any) -> dict[str, Any]:
    """The probe's inherited state; one command line and log for every start, so that
    two starts' argv and descriptors compare equal."""
    out = tmp_path / "state.json"
    p = probe(spawner, tmp_path / "probe.log", "state", str(out), **kw)
    assert p.proc.wait(120) == 0, p.log_tail()
    assert p.spawned_by == spawner.name
    seen: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return seen


GLIBC_SIGNALS = (32, 33)
"""glibc's own (SIGCANCEL, SIGSETXID), caught once a process has made a thread: a fresh
reference server has them too (its torch import starts OpenBLAS's pool)."""


def kernel_dispositions(seen: dict[str, Any]) -> dict[str, int]:
    """SigIgn, SigCgt and SigBlk as the kernel has them (handlers set from C too)."""
    glibc = sum(1 << (s - 1) for s in GLIBC_SIGNALS)
    return {k: int(v, 16) & ~glibc for k, v in seen["caught_ignored"].items()}


def sleeping(p: ManagedProcess) -> ManagedProcess:
    wait_until(lambda: "sleeping" in p.log_tail() or not p.alive(), 60, 0.02)
    assert p.alive(), p.log_tail()
    return p


def test_a_forked_child_inherits_what_a_fresh_one_does(full: ZygoteSpawner, tmp_path: Path) -> None:
    fresh = probe_state(FRESH, tmp_path)
    forked = probe_state(full, tmp_path)
    again = probe_state(full, tmp_path)
    for key in INHERITED:
        assert forked[key] == fresh[key], key
    assert kernel_dispositions(forked) == kernel_dispositions(fresh)
    assert forked["fds"] == [0, 1, 2] and forked["threads"] == 1
    assert forked["std"][1] == forked["std"][2] == str(tmp_path / "probe.log")
    assert forked["env"]["HSQ_PROBE"] == "1" and forked["cwd"] == str(TESTS)
    # Seeds of its own: not the zygote's, not a sibling's.
    assert forked["torch_seed"] is not None and forked["numpy_random"] is not None
    for key in ("random", "torch_seed", "numpy_random"):
        assert forked[key] != again[key], key


@pytest.mark.parametrize("kind", ["fresh", "zygote"])
def test_exit_codes_and_signals_come_back_as_popen_gives_them(
    kind: str, light: ZygoteSpawner, tmp_path: Path
) -> None:
    spawner: Spawner = light if kind == "zygote" else FRESH
    assert probe(spawner, tmp_path / "exit.log", "exit", "3").proc.wait(60) == 3
    raised = probe(spawner, tmp_path / "raise.log", "raise")
    assert raised.proc.wait(60) == 1
    assert "RuntimeError: the probe raised" in raised.log_tail()
    killed = sleeping(probe(spawner, tmp_path / "kill.log", "sleep"))
    with pytest.raises(subprocess.TimeoutExpired):
        killed.proc.wait(0.1)
    assert killed.proc.poll() is None and killed.alive()
    killed.proc.kill()
    assert killed.proc.wait(60) == -signal.SIGKILL and killed.proc.returncode == -9
    assert not killed.alive()
    killed.signal(signal.SIGTERM)  # a signal after the end reaches no other process
    termed = sleeping(probe(spawner, tmp_path / "term.log", "sleep"))
    assert termed.stop() == -signal.SIGTERM


@pytest.mark.parametrize("kind", ["fresh", "zygote"])
def test_a_new_session_child_leads_its_group(
    kind: str, light: ZygoteSpawner, tmp_path: Path
) -> None:
    spawner: Spawner = light if kind == "zygote" else FRESH
    seen = probe_state(spawner, tmp_path, new_session=True)
    assert seen["session_leader"] and seen["group_leader"]
    assert not probe_state(spawner, tmp_path)["group_leader"]
    group = sleeping(probe(spawner, tmp_path / "group.log", "sleep", new_session=True))
    group.signal_group(signal.SIGTERM)
    assert group.proc.wait(60) == -signal.SIGTERM


HOLDER = """
import json, signal, sys
from pathlib import Path
from hsq.node.procs import ManagedProcess
from hsq.node.spawn import FRESH
from tests.support.spawner import ZygoteSpawner
kind, log = sys.argv[1], Path(sys.argv[2])
z = ZygoteSpawner(log.with_name("zygote.log"), preload=("json",))
p = ManagedProcess([sys.executable, "-m", "zygote_probe", "sleep"], log,
                   parent_death_signal=signal.SIGTERM, spawner=z if kind == "zygote" else FRESH)
print(json.dumps({"child": p.pid, "zygote": z.pid}), flush=True)
signal.pause()
"""


@pytest.mark.parametrize("kind", ["fresh", "zygote"])
def test_the_parent_death_signal_follows_the_process_that_asked(kind: str, tmp_path: Path) -> None:
    """The holder (the test process's stand-in) dies by SIGKILL: its child gets SIGTERM,
    through the zygote's own death where it came from the zygote."""
    log = tmp_path / "child.log"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, kind, str(log)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        pids = json.loads(holder.stdout.readline())
        wait_until(lambda: log.exists() and "sleeping" in log.read_text(), 60, 0.02)
        assert state(pids["child"]) not in ("", "Z")
        holder.kill()
        holder.wait(30)
        gone = ("", "Z", "X")  # reaped by init, or a zombie of a non-reaping pid 1
        wait_until(lambda: state(pids["child"]) in gone, 60, 0.02)
        if pids["zygote"] is not None:
            wait_until(lambda: state(pids["zygote"]) in gone, 60, 0.02)
    finally:
        holder.kill()
        holder.wait(30)
        if holder.stdout is not None:
            holder.stdout.close()


def test_the_child_records_its_parent_death_signal(full: ZygoteSpawner, tmp_path: Path) -> None:
    for spawner in (FRESH, full):
        seen = probe_state(spawner, tmp_path, parent_death_signal=signal.SIGUSR1)
        assert seen["pdeathsig"] == signal.SIGUSR1


def test_a_dead_zygote_is_an_error_not_an_exit_code(light: ZygoteSpawner, tmp_path: Path) -> None:
    p = sleeping(probe(light, tmp_path / "orphan.log", "sleep"))
    try:
        assert light.pid is not None
        os.kill(light.pid, signal.SIGKILL)
        with pytest.raises(HsqError, match="zygote went away"):
            wait_until(lambda: p.proc.poll() is not None, 60, 0.02)
    finally:
        os.kill(p.pid, signal.SIGKILL)  # the zygote's orphan: nobody else ends it


def test_what_the_zygote_cannot_start_as_a_fresh_start_would_is_started_fresh(
    light: ZygoteSpawner, tmp_path: Path
) -> None:
    """An environment that differs in what an import may read (here OMP_NUM_THREADS), or
    another command line than `python -m`, gets a fresh exec."""
    assert probe(light, tmp_path / "a.log", "exit", "0").spawned_by == "zygote"
    omp = ManagedProcess(
        [sys.executable, "-m", "zygote_probe", "exit", "0"],
        tmp_path / "omp.log",
        env={"OMP_NUM_THREADS": "1"},
        spawner=light,
    )
    assert omp.spawned_by == "fresh" and omp.proc.wait(60) == 0
    script = ManagedProcess([sys.executable, "-c", "pass"], tmp_path / "c.log", spawner=light)
    assert script.spawned_by == "fresh" and script.proc.wait(60) == 0
    assert light.starts == {"zygote": 1, "fresh": 2}


def test_run_captures_stdout_and_stderr_apart_as_subprocess_run_does(
    light: ZygoteSpawner, tmp_path: Path
) -> None:
    """ZygoteSpawner.run (tests/helpers.py's `hsq_process()`): the same CompletedProcess as
    subprocess.run with capture_output, text and stdin DEVNULL, the child forked here."""
    argv = [sys.executable, "-m", "zygote_probe", "speak", "5"]
    env = {**os.environ, "HSQ_PROBE": "1"}
    want = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=env
    )
    got = light.run(argv, env, 60)
    assert light.starts == {"zygote": 1, "fresh": 0}
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert got.returncode == 5 and got.stdout.startswith("out: one\nout: two \u00e9\n")
    assert "stdin: ''" in got.stdout and got.stderr == "err: one\nerr: two\n"
    seen = tmp_path / "state.json"
    assert (
        light.run([sys.executable, "-m", "zygote_probe", "state", str(seen)], env, 60).returncode
        == 0
    )
    stdin, stdout, stderr = json.loads(seen.read_text())["std"]
    assert stdin == os.devnull and stdout != stderr
    # What the zygote cannot start as a fresh start would is run fresh, with the same result.
    fresh = light.run(argv, {**env, "OMP_NUM_THREADS": "1"}, 60)
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (5, want.stdout, want.stderr)
    assert light.starts == {"zygote": 2, "fresh": 0}  # subprocess.run, not spawn


def test_run_kills_a_child_past_its_timeout_as_subprocess_run_does(light: ZygoteSpawner) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        light.run([sys.executable, "-m", "zygote_probe", "sleep"], dict(os.environ), 0.5)
    assert light.starts["zygote"] == 1
    assert light.pid is not None and children(light.pid) == []  # killed and reaped
    out = light.run([sys.executable, "-m", "zygote_probe", "exit", "0"], dict(os.environ), 60)
    assert out.returncode == 0  # the zygote serves on


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["fresh", "zygote"])
def test_a_forked_worker_behaves_as_a_fresh_one_under_its_signals(
    kind: str, full: ZygoteSpawner, redis_url: str, tmp_path: Path
) -> None:
    """`hsq worker` forked from the zygote (as tests/helpers.py's start_worker starts it)
    against a real null server and Redis: it does the run with its persist processes
    (fresh execs of its own), SIGSTOP stops it and SIGCONT resumes it, SIGTERM ends it
    with exit 0 after `worker_stopped`; another dies by SIGKILL with -9. A fresh one the
    same."""
    spawner: Spawner = full if kind == "zygote" else FRESH
    n = 30
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, n, seed=5, min_len=16, max_len=96)
    enqueue(ds, "zw", tmp_path / "out", redis_url)
    srv = NullServer(tmp_path / "dumps", tmp_path / "srv.log", spawner=full).wait_ready()
    st = store(redis_url, "zw")
    workers: list[ManagedProcess] = []
    try:
        log = tmp_path / "w.log"
        w = worker_process(
            "zw", srv.url, srv.dump_dir, redis_url, log, "--persist-procs", "1", spawner=spawner
        )
        workers.append(w)
        assert w.spawned_by == kind
        wait_until(lambda: st.counts().done == n or not w.alive(), 120)
        assert w.alive(), w.log_tail()
        persist = [c for c in children(w.pid) if "hsq.workers.persist.procs" in _cmdline(c)]
        assert len(persist) == 1, w.log_tail()
        w.signal(signal.SIGSTOP)
        wait_until(lambda: state(w.pid) in ("T", "t"), 30, 0.02)
        w.signal(signal.SIGCONT)
        wait_until(lambda: state(w.pid) not in ("T", "t"), 30, 0.02)
        w.signal(signal.SIGTERM)
        assert w.proc.wait(60) == 0, w.log_tail()
        assert len(log_events(log, "worker_stopped")) == 1
        wait_until(lambda: all(state(c) in ("", "Z", "X") for c in persist), 30, 0.05)
        killed = worker_process(
            "zw", srv.url, srv.dump_dir, redis_url, tmp_path / "k.log", spawner=spawner
        )
        workers.append(killed)
        wait_until(lambda: bool(log_events(killed.log_path, "worker_started")), 60)
        killed.proc.kill()
        assert killed.proc.wait(60) == -signal.SIGKILL
    finally:
        for p in workers:
            p.stop()
        srv.stop()
    assert st.counts().done == n
