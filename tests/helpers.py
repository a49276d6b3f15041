"""Helpers for tests that drive hsq's real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hsq.node.procs import ManagedProcess, worker_process
from hsq.runstore import RunStore
from hsq.store import connect
from hsq.workers.settings import EngineApi, ExchangeTuning, WorkerSettings, WorkerTuning
from tests.support import inproc
from tests.support.procs import ReferenceServer
from tests.support.spawner import ZygoteSpawner, installed


def hsq_argv(*args: str) -> list[str]:
    """The command line of `hsq ARGS` in this interpreter, JSON logs on stderr."""
    return [sys.executable, "-m", "hsq", "--log-format", "json", *args]


def hsq(
    *args: str, check: bool = False, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`hsq ARGS` called in this process (tests.support.inproc), JSON logs on stderr, no
    terminal on stdin (prompts refuse), output captured as a subprocess's would be. For the
    tests that check a command's output and exit code; `hsq_process` where the process
    itself is the point (and for the commands that serve or end in os._exit)."""
    proc = inproc.call(["--log-format", "json", *args], env)
    if check and proc.returncode != 0:
        raise AssertionError(f"hsq {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def hsq_process(
    *args: str,
    timeout: float = 120,
    check: bool = False,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`hsq ARGS` as a subprocess, no terminal on stdin (prompts refuse), output captured:
    forked from the session's zygote (tests.support.spawner) where one is installed and the
    environment allows, else a fresh exec."""
    spawner = installed()
    if isinstance(spawner, ZygoteSpawner):
        proc = spawner.run(hsq_argv(*args), os.environ if env is None else env, timeout)
    else:
        proc = subprocess.run(
            hsq_argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
        )
    if check and proc.returncode != 0:
        raise AssertionError(f"hsq {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def enqueue(dataset: Path, run: str, out: Path, redis_url: str, *extra: str) -> str:
    """`hsq enqueue` (in process); its stdout (the counts)."""
    args = ["enqueue", str(dataset), "--run", run, "--out", str(out), "--redis", redis_url]
    return hsq(*args, "--no-progress", *extra, check=True).stdout


def spawn_worker(*args: Any, **kw: Any) -> ManagedProcess:
    """hsq.node.procs.worker_process, the worker forked from the session's zygote where
    one is installed (tests.support.spawner; a fresh exec where it cannot be)."""
    return worker_process(*args, spawner=installed(), **kw)


def start_worker(
    base: Path, run: str, server: ReferenceServer, redis_url: str, *extra: str, name: str = "w"
) -> ManagedProcess:
    """`hsq worker` for `server`, forked from the session's zygote where one is installed."""
    log = base / f"{name}.log"
    return spawn_worker(run, server.url, server.dump_dir, redis_url, log, "--name", name, *extra)


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.2) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - t0


def store(redis_url: str, run: str) -> RunStore:
    return RunStore(connect(redis_url), run)


def log_events(path: Path, event: str) -> list[dict[str, object]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out


def children(pid: int) -> list[int]:
    """The pids of a process's children (its persist processes), from /proc."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def state(pid: int) -> str:
    """The process's state letter (T: stopped, Z: a zombie whose temp is still there), or
    "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def worker_settings(**flat: Any) -> WorkerSettings:
    """A WorkerSettings from flat names, as `hsq worker`'s flags are (run=, inflight=,
    dump_timeout_s=, engine=, ...): each goes to the record that holds it."""

    def part(cls: type[Any]) -> dict[str, Any]:
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: flat.pop(k) for k in list(flat) if k in names}

    exchange = ExchangeTuning(**part(ExchangeTuning))
    tuning = WorkerTuning(exchange=exchange, **part(WorkerTuning))
    return WorkerSettings(api=EngineApi(**part(EngineApi)), tuning=tuning, **flat)
