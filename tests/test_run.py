"""`hsq run` end to end: real redis-server (its own, under OUT/.hsq/), real reference
servers and workers over real HTTP, real signals to the whole process group.

Each test waits for events (N done in Redis, a worker's `sample_done` log line), never for
time. "Each sample once" is proved as tests/test_queue.py proves it: by the workers'
`sample_done` events, one per sample across every invocation, and by the done ledger.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from hsq.app.node.supervisor import dump_dir_for
from hsq.harness.synthetic import write_synthetic
from hsq.runstore import RunStore
from hsq.store import connect
from tests.helpers import wait_until

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="process groups, /dev/shm"),
    # Every `hsq run` starts servers that import torch: minutes on a loaded 2-core machine.
    pytest.mark.timeout(600),
]

SAMPLES = 40
NO_REDIS = ("REDIS_URL", "HSQ_REDIS_URL", "HSQ_REDIS_URL_FILE")


class Node:
    """One `hsq run` as a user starts it from a shell: the leader of its own process group."""

    started: ClassVar[list[Node]] = []

    def __init__(self, tmp: Path, tag: str, *args: str) -> None:
        Node.started.append(self)
        self.stdout = tmp / f"{tag}.out"
        self.stderr = tmp / f"{tag}.err"
        env = {k: v for k, v in os.environ.items() if k not in NO_REDIS}
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.stdout, "ab") as out, open(self.stderr, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hsq", "run", *args],
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


@pytest.fixture(autouse=True)
def _no_node_left() -> Iterator[None]:
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


def test_kill_9_of_the_group_then_the_same_command_does_each_sample_once(tmp_path: Path) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, SAMPLES, seed=3, min_len=4, max_len=48)
    out = tmp_path / "out"
    # Slow answers, so the kill surely lands mid-run (mid-chunk, requests in flight).
    args = [str(ds), "--out", str(out), "--servers", "2", "--chunk-size", "4", "--json",
            "--verify", "--", "--fault", "slow:seconds=0.2"]  # fmt: skip
    first = Node(tmp_path, "first", *args)
    st = run_store(out, "data")
    wait_until(lambda: st.count(st.keys.done) >= 8, 180, interval=0.05)
    os.killpg(first.proc.pid, signal.SIGKILL)  # hsq, its servers and workers at once
    first.wait(30)
    # Its redis-server got SIGTERM with hsq's death and wrote its AOF out: serve the same
    # data again to see what was done at the kill.
    redis_only = Node(tmp_path, "redis-only", "--out", str(out), "--redis-only")
    wait_until(lambda: "Ctrl-C stops it" in redis_only.output(), 60, interval=0.05)
    st = run_store(out, "data")
    done_before = set(st.iter_hash_keys(st.keys.done))
    os.killpg(redis_only.proc.pid, signal.SIGINT)
    assert redis_only.wait(30) == 0
    assert 8 <= len(done_before) < SAMPLES
    offsets = {log: log.stat().st_size for log in worker_logs(out)}

    again = Node(tmp_path, "again", *args)  # the same command: same Redis data, password
    assert again.wait() == 0, again.output()
    summary = again.summary()
    status = summary["status"]
    assert isinstance(status, dict) and status["done"] == SAMPLES and status["dead"] == 0
    assert summary["verified"] == {"checked": SAMPLES, "ok": SAMPLES, "problems": 0}
    redone = done_events(worker_logs(out), offsets)
    assert not set(redone) & done_before  # nothing done before the kill was done again
    per_sample = Counter(done_events(worker_logs(out)))
    assert max(per_sample.values()) == 1  # and nothing twice
    assert set(redone) | done_before == {
        json.loads(x)["id"] for x in ds.read_text().split("\n") if x
    }
    files = list((out / "data").rglob("*"))
    assert len([p for p in files if p.suffix == ".safetensors"]) == SAMPLES
    assert not [p for p in files if p.name.endswith(".tmp")]
    assert (out / ".hsq" / "redis-password").stat().st_mode & 0o777 == 0o600
    assert not [i for i in (0, 1) if dump_dir_for(out / ".hsq", "data", i).exists()]


def test_a_joining_node_shares_the_work_and_its_ctrl_c_hands_back(tmp_path: Path) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, SAMPLES, seed=4, min_len=4, max_len=48)
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    # A's server answers slowly (one request at a time) until B has done samples, so A
    # cannot finish the run alone while B is starting; B's answers are slowed a little so
    # it is mid-work at Ctrl-C.
    a = Node(tmp_path, "a", str(ds), "--out", str(out_a), "--node-name", "first",
             "--chunk-size", "2", "--inflight", "1", "--json",
             "--", "--fault", "slow:seconds=3")  # fmt: skip
    st = run_store(out_a, "data")
    b = Node(tmp_path, "b", "--join", "--run", "data", "--out", str(out_b),
             "--redis-url-file", str(out_a / ".hsq" / "redis-url"), "--node-name", "joiner",
             "--", "--fault", "slow:seconds=0.3")  # fmt: skip
    wait_until(lambda: len(done_events(worker_logs(out_b))) >= 2, 180, interval=0.05)
    os.killpg(b.proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group gets it
    assert b.wait(60) == 128 + signal.SIGINT, b.output()
    assert "interrupted" in b.output()
    held = st.outstanding_samples()
    assert not [place for place in held.values() if "joiner" in place]  # handed back
    assert not [w for w in st.workers_info().values() if w.get("name", "").startswith("joiner")]

    a_server = next(w["server"] for w in st.workers_info().values() if w.get("name") == "first-0")
    httpx.delete(a_server + "/admin/faults").raise_for_status()  # A finishes the rest
    assert a.wait() == 0, a.output()
    status = a.summary()["status"]
    assert isinstance(status, dict) and status["done"] == SAMPLES and status["dead"] == 0
    by_b = done_events(worker_logs(out_b))
    per_sample = Counter(done_events(worker_logs(out_a)) + by_b)
    assert len(per_sample) == SAMPLES and set(per_sample.values()) == {1}
    assert 2 <= len(by_b) < SAMPLES
