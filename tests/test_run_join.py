"""`hsq run --join`: a second node adds its server and worker to the first one's run (its
Redis, through OUT/.hsq/redis-url), shares the work, and hands back on Ctrl-C (SIGINT to
its whole process group), exit 130; the first node then finishes, each sample once.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from hsq.producer.synthetic import write_synthetic
from tests.helpers import wait_until
from tests.run_helpers import SAMPLES, Node, done_events, no_node_left, run_store, worker_logs

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="process groups, /dev/shm"),
    # Every `hsq run` starts servers that import torch: minutes on a loaded 2-core machine.
    pytest.mark.timeout(600),
    pytest.mark.usefixtures(no_node_left.__name__),
]


def test_a_joining_node_shares_the_work_and_its_ctrl_c_hands_back(tmp_path: Path) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, SAMPLES, seed=4, min_len=4, max_len=48)
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    # A's server answers slowly (one request at a time) until B has done samples, so A
    # cannot finish the run alone while B is starting; B's answers are slowed a little so
    # it is mid-work at Ctrl-C.
    a = Node(
        tmp_path,
        "a",
        str(ds),
        "--out",
        str(out_a),
        "--node-name",
        "first",
        "--chunk-size",
        "2",
        "--inflight",
        "1",
        "--json",
        "--",
        "--fault",
        "slow:seconds=3",
        "--admin",
    )  # fmt: skip (admin: the test
    # clears A's fault below; a run's servers take none unless asked)
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
    workers = st.workers.workers_info().values()
    assert not [w for w in workers if w.get("name", "").startswith("joiner")]

    a_server = next(w["server"] for w in workers if w.get("name") == "first-0")
    httpx.delete(a_server + "/admin/faults").raise_for_status()  # A finishes the rest
    assert a.wait() == 0, a.output()
    status = a.summary()["status"]
    assert isinstance(status, dict) and status["done"] == SAMPLES and status["dead"] == 0
    by_b = done_events(worker_logs(out_b))
    per_sample = Counter(done_events(worker_logs(out_a)) + by_b)
    assert len(per_sample) == SAMPLES and set(per_sample.values()) == {1}
    assert 2 <= len(by_b) < SAMPLES
