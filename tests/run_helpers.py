"""`hsq run` as a user starts it, for tests/test_run*.py: the leader of its own process
group, its output in files, its Redis found through OUT/.hsq/redis-url."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from hsq.runstore import RunStore
from hsq.store import connect
from tests.helpers import wait_until

SAMPLES = 40
NO_REDIS = ("REDIS_URL", "HSQ_REDIS_URL", "HSQ_REDIS_URL_FILE")


class Node:
    """One `hsq run` as a user starts it from a shell: the leader of its own process group."""

    started: ClassVar[list[Node]] = []

    def __init__(
        self, tmp: Path, tag: str, *args: str, prefix: Sequence[str] = (), **more_env: str
    ) -> None:
        """`prefix`: run it elsewhere (`ip netns exec NS`: another host)."""
        Node.started.append(self)
        self.stdout = tmp / f"{tag}.out"
        self.stderr = tmp / f"{tag}.err"
        env = {k: v for k, v in os.environ.items() if k not in NO_REDIS}
        env.update(more_env, PYTHONUNBUFFERED="1")
        with open(self.stdout, "ab") as out, open(self.stderr, "ab") as err:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "hsq", "run", *args],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"hsq run still running:\n{self.output()}") from None

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def summary(self) -> dict[str, object]:
        lines = [x for x in self.stdout.read_text().splitlines() if x.startswith("{")]
        return dict(json.loads(lines[-1]))


def nodes_output(tail: int = 4000) -> str:
    """The end of every `hsq run` this test started, for a failure that shows elsewhere (a
    trainer waiting on a Redis its node no longer serves)."""
    return "\n".join(f"--- hsq run {n.stdout.stem}:\n{n.output()[-tail:]}" for n in Node.started)


@pytest.fixture
def no_node_left() -> Iterator[None]:
    """A failed test leaves no `hsq run` (nor its children) behind."""
    yield
    while Node.started:
        node = Node.started.pop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait(10)


def run_store(out: Path, run: str) -> RunStore:
    url_file = out / ".hsq" / "redis-url"
    wait_until(lambda: url_file.exists(), 120, interval=0.1)
    return RunStore(connect(url_file.read_text().strip()), run)


def worker_logs(out: Path) -> list[Path]:
    return sorted((out / ".hsq" / "logs").glob("worker-*.log"))


def done_events(logs: list[Path], offsets: dict[Path, int] | None = None) -> list[str]:
    """Sample ids of `sample_done` events, in the part of each log after `offsets`."""
    ids: list[str] = []
    for log in logs:
        text = log.read_bytes()[(offsets or {}).get(log, 0) :].decode(errors="replace")
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by the kill, or not a log record
            if isinstance(rec, dict) and rec.get("event") == "sample_done":
                ids.append(str(rec["sample"]))
    return ids


class Watch:
    """The spool's peak on disk (the run's output files), all through a streamed run."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.peak_disk = 0
        self.largest = 0
        self.sizes: dict[str, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            total = 0
            for p in self.run_dir.rglob("*.safetensors") if self.run_dir.exists() else []:
                try:
                    size = p.stat().st_size
                except FileNotFoundError:
                    continue  # removed after its commit while we looked
                total += size
                self.sizes[p.name] = size
                self.largest = max(self.largest, size)
            self.peak_disk = max(self.peak_disk, total)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()
