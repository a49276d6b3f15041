"""A worker whose log pipe lost its reader (`hsq worker ... 2>&1 | tee w.log`, then tee
dies, as a terminal's Ctrl-C kills the whole pipeline) still stops on SIGTERM and hands
every job it held back: a log write that fails (EPIPE) or blocks never runs inside the
stop signal's handler, and the log stream survives the lost reader.

Real parts: a redis-server, a reference server answering slowly (so jobs are held when
the signal comes), the worker as its own process with stdout and stderr on a pipe whose
reader (`cat`, standing in for tee) is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hsq.producer.synthetic import write_synthetic
from tests.helpers import enqueue, hsq_argv, store, wait_until

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="pipes and signals as on Linux"),
    pytest.mark.timeout(300),
]


def test_a_worker_whose_log_reader_died_stops_on_sigterm_and_hands_back(
    tmp_path: Path, redis_url: str, server_factory: Any
) -> None:
    srv = server_factory("--fault", "slow:seconds=0.3", name="pipe").wait_ready()
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 40, seed=5, min_len=4, max_len=24)
    enqueue(ds, "pipe", tmp_path / "out", redis_url, "--chunk-size", "4")
    st = store(redis_url, "pipe")

    read_end, write_end = os.pipe()
    reader = subprocess.Popen(["cat"], stdin=read_end, stdout=subprocess.DEVNULL)
    argv = hsq_argv("worker", "--run", "pipe", "--server", srv.url, "--dump-dir",
                    str(srv.dump_dir), "--name", "piped", "--inflight", "4")  # fmt: skip
    # No PYTHONUNBUFFERED, as in a user's shell: stderr buffers, and the failed write stays
    # in its buffer for the interpreter's last flush (exit 1 before the fix).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["HSQ_REDIS_URL"] = redis_url
    worker = subprocess.Popen(argv, stdout=write_end, stderr=write_end, env=env)
    os.close(read_end)
    os.close(write_end)
    try:
        wait_until(lambda: st.count(st.keys.done) >= 4, 120, interval=0.05)
        reader.kill()  # the tee is gone; the worker's next log lines meet EPIPE
        reader.wait(10)
        done_then = st.count(st.keys.done)
        # It goes on (a lost log reader is no reason to stop) and logs into the dead pipe.
        wait_until(lambda: st.count(st.keys.done) >= done_then + 4, 120, interval=0.05)
        assert st.snapshot().held_jobs >= 1  # it holds work when the stop comes
        worker.send_signal(signal.SIGTERM)
        rc = worker.wait(60)  # before the fix: a hang until SIGKILL, or exit 1 holding jobs
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
        if reader.poll() is None:
            reader.kill()
    snap = st.snapshot()
    assert rc == 0 and snap.held_jobs == 0, (rc, snap)
    # Every sample is done or back in the queue: nothing held by the stopped worker.
    assert snap.done + snap.stats.main_samples + snap.stats.retry_samples == 40, snap
