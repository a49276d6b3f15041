"""Many nodes: Redis outages, and hosts in network namespaces losing their link mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from hsq.node.procs import (
    ManagedProcess,
    RedisServer,
    exporter_process,
    free_port,
    hsq_command,
    worker_process,
)
from hsq.ops import verify
from hsq.producer.synthetic import write_synthetic
from tests.helpers import enqueue, log_events, start_worker, store, wait_until
from tests.support.netns import Netns, clean_stale_netns, needs_netns, netns_names
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]


@pytest.mark.realproc
def test_redis_restart_with_aof_keeps_the_queue_and_workers_carry_on(
    tmp_path: Path, server_factory: Factory
) -> None:
    srv = server_factory("--fault", "slow:seconds=0.05", name="aofsrv").wait_ready()
    rdir = tmp_path / "redis"
    redis1 = RedisServer(rdir, password="pw", appendonly=True).wait_ready()
    url = redis1.url
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 60, seed=21, min_len=4, max_len=32)
    enqueue(ds, "aof", tmp_path / "out", url, "--chunk-size", "4", "--max-attempts", "1")
    st = store(url, "aof")
    w = start_worker(tmp_path, "aof", srv, url, "--burst", name="survivor")
    redis2 = None
    try:
        wait_until(lambda: st.count(st.keys.done) >= 10, 60, interval=0.05)
        redis1.signal(signal.SIGKILL)  # a crash, not a clean shutdown
        redis1.proc.wait(10)
        # Down longer than the client's own retries: the worker backs off itself.
        wait_until(lambda: bool(log_events(w.log_path, "redis_unavailable")), 60, interval=0.1)
        assert w.alive()
        redis2 = RedisServer(rdir, password="pw", appendonly=True, port=redis1.port).wait_ready()
        assert w.proc.wait(120) == 0, w.log_tail()
        st = store(url, "aof")
        assert st.count(st.keys.done) == 60 and st.count(st.keys.dead) == 0
        assert verify(st, tmp_path / "out" / "aof", deep=True).ok == 60
        assert log_events(w.log_path, "redis_unavailable")
    finally:
        w.stop()
        if redis2 is not None:
            redis2.stop()


def test_stale_namespaces_of_a_killed_session_are_removed() -> None:
    needs_netns()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has exited: the session that "owned" the names
    net, mine = Netns(gone.pid), Netns(os.getpid())
    try:
        try:
            net.add("B")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
        mine.add("B")  # a live session's names are left alone
        removed = clean_stale_netns()
        assert set(removed) >= {f"{net.tag}B", f"{net.tag}B0"}
        assert f"{net.tag}B" not in netns_names()
        assert f"{mine.tag}B" in netns_names()
    finally:
        net.cleanup()
        mine.cleanup()


def test_a_host_losing_its_link_mid_run(tmp_path: Path, netns: Netns) -> None:
    """A: Redis + exporter (root namespace). B, C: a reference server and a worker each."""
    (_, root_b, _), (_, root_c, _) = netns.hosts["B"], netns.hosts["C"]
    redis_srv = RedisServer(
        tmp_path / "redis", password="pw", appendonly=True, bind=("127.0.0.1", root_b, root_c)
    ).wait_ready()
    local_url = redis_srv.url
    exporter = exporter_process(local_url, free_port(), tmp_path / "exporter.log")
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 80, seed=31, min_len=4, max_len=32)
    out = tmp_path / "out"
    enqueue(ds, "net", out, local_url, "--chunk-size", "4")
    procs: dict[str, ManagedProcess] = {"exporter": exporter}
    for host, root_ip in (("B", root_b), ("C", root_c)):
        port = 30000
        procs[f"server{host}"] = ManagedProcess(
            [
                *netns.exec(host),
                *hsq_command(
                    "serve-reference",
                    "--dump-dir",
                    str(tmp_path / f"dumps{host}"),
                    "--port",
                    str(port),
                    "--threads",
                    "1",
                    "--fault",
                    "slow:seconds=0.1",
                ),
            ],
            tmp_path / f"server{host}.log",
        )
        procs[f"worker{host}"] = worker_process(
            "net",
            f"http://127.0.0.1:{port}",
            tmp_path / f"dumps{host}",
            f"redis://:pw@{root_ip}:{redis_srv.port}/0",
            tmp_path / f"worker{host}.log",
            "--name",
            f"host{host}",
            prefix=netns.exec(host),
        )
    st = store(local_url, "net")
    try:
        wait_until(lambda: bool(log_events(procs["workerB"].log_path, "sample_done")), 90)
        wait_until(lambda: st.count(st.keys.done) >= 20, 90, interval=0.05)
        assert st.count(st.keys.done) < 80
        netns.link("B", up=False)
        cut = time.monotonic()
        # C finishes everything, including what B held when its link went down.
        wait_until(lambda: st.count(st.keys.done) == 80, 120, interval=0.2)
        recovered_in = time.monotonic() - cut
        assert recovered_in < 90
        assert log_events(procs["workerC"].log_path, "recovered_dead_worker_jobs")
        assert st.count(st.keys.dead) == 0
        logged = {
            host: [str(e["sample"]) for e in log_events(procs[f"worker{host}"].log_path,
                                                        "sample_done")]
            for host in ("B", "C")
        }  # fmt: skip
        per_sample = Counter(logged["B"] + logged["C"])
        assert set(per_sample.values()) == {1}  # never acknowledged twice
        # Each done entry names the worker that marked it, and it is the one that logged it.
        # A batched mark Redis applied while the cut link lost its reply has no log line
        # (B cannot know it landed; seen once under load: a chunk of 4): it must be B's.
        ids = [json.loads(x)["id"] for x in ds.read_text().splitlines()]
        marked_by = {}
        for sid in ids:
            entry = st.get_manifest(sid)
            assert entry is not None, sid
            marked_by[sid] = entry.worker.split(".")[0]
        for host in ("B", "C"):
            assert all(marked_by[sid] == f"host{host}" for sid in logged[host])
        assert all(marked_by[sid] == "hostB" for sid in set(ids) - set(per_sample))
        files = list((out / "net").rglob("*"))
        assert len([p for p in files if p.suffix == ".safetensors"]) == 80
        assert not [p for p in files if p.name.endswith(".tmp")]
        assert verify(st, out / "net", deep=True).ok == 80

        # B comes back and rejoins: it takes work again. New work is enqueued once B's
        # heartbeat is back in Redis (C reaped it), or C alone might finish it first.
        netns.link("B", up=True)

        def b_is_back() -> bool:
            ids = st.workers.worker_ids()
            return any(w.startswith("hostB.") and st.workers.worker_info(w) for w in ids)

        wait_until(b_is_back, 120)
        more = tmp_path / "more.jsonl"
        write_synthetic(more, 120, seed=31, min_len=4, max_len=32)  # the first 80 are the same
        ds.write_text(more.read_text())
        enqueue(ds, "net", out, local_url, "--chunk-size", "2")
        wait_until(lambda: st.count(st.keys.done) == 120, 120, interval=0.2)
        new_ids = {json.loads(x)["id"] for x in more.read_text().splitlines()[80:]}
        by_b = [
            e
            for e in log_events(procs["workerB"].log_path, "sample_done")
            if e["sample"] in new_ids
        ]
        assert by_b, "host B did not rejoin"
        assert st.count(st.keys.dead) == 0
    finally:
        for p in procs.values():
            p.stop()
        redis_srv.stop()
