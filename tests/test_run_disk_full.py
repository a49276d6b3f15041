"""`hsq run` whose --out disk fills up (a tmpfs of a few MB): the workers pause with
"output disk full" in the live view and the summary, the run's own Redis (its AOF on the
same disk) keeps working, and once there is space again the same command finishes the
run, all done and verified. Before, Redis's AOF write failed (MISCONF), the workers'
heartbeats failed, they exited, and the run ended "no worker of this node running".
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hsq.ops.status import run_status
from hsq.producer.synthetic import write_synthetic
from hsq.store import connect
from tests.helpers import wait_until
from tests.run_helpers import Node, no_node_left, run_store

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="tmpfs, process groups"),
    pytest.mark.timeout(600),
    pytest.mark.usefixtures(no_node_left.__name__),
]
SAMPLES = 30


def _fill(path: Path) -> None:
    """Write `path` until the disk is full."""
    with open(path, "wb") as f:
        block = b"\0" * (64 << 10)
        while True:
            try:
                f.write(block)
                f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())


def _disk_full_seen(st: object) -> bool:
    return any("disk full" in (w.cause_text or "") for w in run_status(st).workers)  # type: ignore[arg-type]


def test_a_full_output_disk_pauses_the_run_and_redis_lives(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    try:
        ds = tmp_path / "data.jsonl"
        write_synthetic(ds, SAMPLES, seed=7, min_len=4, max_len=48)
        args = [str(ds), "--out", str(disk), "--chunk-size", "2", "--inflight", "1"]
        first = Node(tmp_path, "first", *args, "--", "--fault", "slow:seconds=0.3")
        st = run_store(disk, "data")
        wait_until(lambda: st.count(st.keys.done) >= 4, 180, interval=0.1)
        _fill(disk / "junk")
        wait_until(lambda: _disk_full_seen(st), 120, interval=0.2)
        # The live view says so (a line every 10 s when not on a terminal).
        wait_until(lambda: "disk full" in first.stdout.read_text(), 60, interval=0.2)
        url = (disk / ".hsq" / "redis-url").read_text().strip()
        client = connect(url)
        for i in range(200):  # the run's Redis still takes writes on the full disk
            client.set(f"probe:{i}", "x" * 100)
        client.delete(*[f"probe:{i}" for i in range(200)])
        assert client.info("persistence")["aof_last_write_status"] == "ok"
        assert first.proc.poll() is None, first.output()  # no worker died: still running
        os.killpg(first.proc.pid, signal.SIGINT)
        assert first.wait(120) == 128 + signal.SIGINT, first.output()
        summary = first.stdout.read_text().split("\nfinished ", 1)[1]
        assert "output disk full" in summary and "interrupted" in summary, summary
        assert "MISCONF" not in first.output() and " exited " not in first.output()

        (disk / "junk").unlink()
        again = Node(tmp_path, "again", *args, "--json", "--verify")
        assert again.wait(300) == 0, again.output()
        status = again.summary()["status"]
        assert isinstance(status, dict) and status["done"] == SAMPLES and status["dead"] == 0
    finally:
        for node in Node.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(30)
        Node.started.clear()
        subprocess.run(["umount", "-l", str(disk)], check=False)
