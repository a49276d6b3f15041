"""`hsq run` end to end: its own redis-server under OUT/.hsq/, two reference servers and
their workers over real HTTP, a kill -9 of the whole process group, the same command again.

Waits for events (N done in Redis), never for time. "Each sample once" is proved as
tests/test_queue.py proves it: by the workers' `sample_done` events, one per sample across
both invocations, and by the done ledger read at the kill. The second invocation is also
the plain case: no Redis given, two servers, exit 0, every output verified (--verify).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest

from hsq.node.supervisor import dump_dir_for
from hsq.producer.synthetic import write_synthetic
from tests.helpers import wait_until
from tests.run_helpers import SAMPLES, Node, done_events, no_node_left, run_store, worker_logs

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="process groups, /dev/shm"),
    # Every `hsq run` starts servers that import torch: minutes on a loaded 2-core machine.
    pytest.mark.timeout(600),
    pytest.mark.usefixtures(no_node_left.__name__),
]


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

    # The same command (same Redis data, password), the engine from its variable: the
    # workers, which inherit HSQ_ENGINE=reference, still speak SGLang's API (their flag).
    again = Node(tmp_path, "again", *args, HSQ_ENGINE="reference")
    assert again.wait() == 0, again.output()
    summary = again.summary()
    status = summary["status"]
    assert isinstance(status, dict) and status["done"] == SAMPLES and status["dead"] == 0
    # The rate is the run's over this command's active time (it was the workers' live
    # rate, 0 once they had ended), and the friendly output holds no structlog line.
    made, active = SAMPLES - len(done_before), summary.get("active_s")
    rate_ok = isinstance(active, float) and active > 0 and status["samples_per_s"] > 0
    rate_ok = rate_ok and abs(status["samples_per_s"] * active - made) <= 0.01 * made
    log_lines = [x for x in again.output().splitlines() if x.startswith('{"') and '"event"' in x]
    assert rate_ok and not log_lines, (summary, log_lines)
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
    # OUT's Redis stopped with the run: no URL file names it, no password file is kept
    # (the next start makes a new password).
    assert not [p.name for p in (out / ".hsq").iterdir() if p.name.startswith("redis-")]
    assert not [i for i in (0, 1) if dump_dir_for(out / ".hsq", "data", i).exists()]
