"""Regression tests for the store side of the worker's reliability (the purge fence, a lost
BLMOVE reply, two enqueues at once, Redis errors) and of "RunStore is the only module that
talks to Redis". Real redis-server throughout."""

from __future__ import annotations

import ast
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hsq.dataset.jsonl import IndexEntry
from hsq.errors import ConfigError, RunChangedError, StoreUnavailableError
from hsq.node.procs import RedisServer
from hsq.ops import RunStatus, run_figures, run_status
from hsq.outputs.manifest import ManifestEntry
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect, list_runs
from tests.helpers import enqueue, hsq, hsq_argv, store

ROOT = Path(__file__).resolve().parent.parent
ENTRY = IndexEntry(0, 10, 0, 3)


def manifest(sid: str) -> ManifestEntry:
    return ManifestEntry(f"00/{sid}.safetensors", 3, 100, "crc32:0", "w", 0.0, 0)


def fresh_run(redis_url: str, run: str, tmp_path: Path) -> RunStore:
    st = store(redis_url, run)
    st.create_config(RunConfig(run=run, dataset=str(tmp_path / "d.jsonl"), out=str(tmp_path)))
    return st


def test_purge_fences_every_write_of_a_store_that_read_the_old_run(
    tmp_path: Path, redis_url: str
) -> None:
    """After `hsq purge` (and a re-create) a worker's store that read the old run must
    not write into it: done marks, finish, give-back, retry enqueue, dead letter, pins and
    heartbeats raise RunChangedError, and the purged done hash does not come back (the old
    code's mark_done recreated it, and a new dataset then skipped those ids)."""
    worker = fresh_run(redis_url, "fenced", tmp_path)
    worker.enqueue([[("a", ENTRY)], [("b", ENTRY)]])
    job = worker.claim("w1", 1)
    assert job is not None
    assert worker.mark_done("a", manifest("a"))
    assert hsq("purge", "--run", "fenced", "--yes", "--redis", redis_url).returncode == 0

    writes: dict[str, Callable[[], object]] = {
        "mark_done": lambda: worker.mark_done("b", manifest("b")),
        "finish": lambda: worker.finish("w1", job),
        "give_back": lambda: worker.give_back("w1", job),
        "retry": lambda: worker.enqueue([[("b", ENTRY)]], retry=True, attempt=1),
        "dead": lambda: worker.to_dead("b", "x", "y", 1, "w1"),
        "pin": lambda: worker.config_index.pin_model("m@1", [1, 2]),
        "heartbeat": lambda: worker.heartbeat("w1", {"state": "busy"}),
        "crash": lambda: worker.record_crash("b"),
    }
    for name, write in writes.items():
        with pytest.raises(RunChangedError):
            write()
        assert worker.client.keys("hsq:run:fenced:*") == [], name
        assert worker.client.keys("rq:queue:hsq-fenced*") == [], name

    # Re-created under the same name: a new generation, so the old holder is still refused.
    fresh_run(redis_url, "fenced", tmp_path)
    with pytest.raises(RunChangedError):
        worker.mark_done("b", manifest("b"))
    assert worker.count(worker.keys.done) == 0
    worker.require_config()  # re-reading the config takes the new generation
    assert worker.mark_done("b", manifest("b"))


class DropReplyProxy:
    """A TCP proxy to Redis that forwards a BLMOVE, swallows its reply and drops the client
    connection, once: a reply really lost on the wire after Redis executed the command."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            swallow = threading.Event()
            args = (client, upstream, swallow)
            threading.Thread(target=self._up, args=args, daemon=True).start()
            threading.Thread(target=self._down, args=args, daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, swallow: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if b"BLMOVE" in data.upper() and not self.dropped.is_set():
                    self.dropped.set()
                    swallow.set()  # set before Redis can answer
                    upstream.sendall(data)
                    return
                upstream.sendall(data)

    def _down(
        self, client: socket.socket, upstream: socket.socket, swallow: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if swallow.is_set():  # Redis moved the job and answered: the reply is lost
                    break
                client.sendall(data)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[DropReplyProxy]:
    p = DropReplyProxy(redis_server.port)
    yield p
    p.close()


def test_a_job_whose_blmove_reply_was_lost_is_claimed_not_stranded(
    tmp_path: Path, redis_url: str, redis_server: RedisServer, proxy: DropReplyProxy
) -> None:
    """redis-py retries a BLMOVE whose reply was lost, so the first job sits in the
    worker's wip list unknown to it (old code: never read again, a --burst worker hung).
    claim() now returns it next."""
    producer = fresh_run(redis_url, "lost", tmp_path)
    producer.enqueue([[(f"s{i}", ENTRY)] for i in range(3)])
    via_proxy = redis_url.replace(f":{redis_server.port}/", f":{proxy.port}/")
    worker = RunStore(connect(via_proxy), "lost")
    worker.require_config()
    claimed = []
    while (job := worker.claim("w1", 1)) is not None:
        claimed.append(job.samples[0][0])
        assert worker.finish("w1", job)
    assert proxy.dropped.is_set(), "the proxy never saw a BLMOVE"
    assert sorted(claimed) == ["s0", "s1", "s2"]
    assert worker.nothing_outstanding()


def test_redis_errors_become_hsq_errors(tmp_path: Path) -> None:
    """Callers see StoreUnavailableError (transient), never a redis
    exception, when Redis goes away under a store."""
    srv = RedisServer(tmp_path / "r", password="pw").wait_ready()
    try:
        st = RunStore(connect(srv.url), "gone")
        st.count(st.keys.done)
    finally:
        srv.stop()
    with pytest.raises(StoreUnavailableError):
        st.count(st.keys.done)
    with pytest.raises(StoreUnavailableError):
        connect(srv.url)


def test_a_second_concurrent_enqueue_is_refused_with_exit_2(tmp_path: Path, redis_url: str) -> None:
    """While one enqueue of a run is running (it holds the run's lock), a second one
    with another --out fails with exit 2 and says why, instead of queueing every sample a
    second time and ignoring its --out."""
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 5, seed=1)
    holder = store(redis_url, "busy")
    with holder.lifecycle.enqueue_lock("test-holder"):
        second = hsq(
            "enqueue", str(ds), "--run", "busy", "--out", str(tmp_path / "b"),
            "--redis", redis_url, "--no-progress",
        )  # fmt: skip
    assert second.returncode == 2, second.stderr
    assert "another `hsq enqueue`" in second.stderr and "test-holder" in second.stderr
    assert holder.load_config() is None and holder.queue_lengths()["main"] == 0
    enqueue(ds, "busy", tmp_path / "a", redis_url)  # the lock is free again
    clash = hsq(
        "enqueue", str(ds), "--run", "busy", "--out", str(tmp_path / "b"),
        "--redis", redis_url, "--no-progress",
    )  # fmt: skip
    assert clash.returncode == 2 and "exists with other settings" in clash.stderr


def test_status_and_exporter_share_figures_and_status_is_a_dataclass(
    tmp_path: Path, redis_url: str
) -> None:
    """`run_status` returns a dataclass; the exporter's sample figures are the ones
    status prints (one function, hsq.ops.run_figures)."""
    from hsq.ops.prometheus import RedisCollector

    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 6, seed=2)
    with ds.open("a") as f:
        f.write("not json\n")
    enqueue(ds, "figs", tmp_path / "o", redis_url)
    st = store(redis_url, "figs")
    st.require_config()
    st.mark_done("s000000", manifest("s000000"))
    status = run_status(st)
    assert isinstance(status, RunStatus)
    fig = run_figures(st)
    assert (status.total, status.done, status.dead) == (fig.total, fig.done, fig.dead) == (7, 1, 1)
    metrics = {
        (m.name, s.labels.get("state")): s.value
        for m in RedisCollector(st.client).collect()
        for s in m.samples
        if s.labels.get("run") == "figs"
    }
    assert metrics[("hsq_run_samples", "total")] == status.total
    assert metrics[("hsq_run_samples", "done")] == status.done
    assert metrics[("hsq_run_samples", "dead")] == status.dead


def test_only_the_store_imports_redis_or_rq() -> None:
    """Nothing outside hsq/store/ imports redis or rq (hsq/node/procs.py
    is the test harness starting a server)."""
    allowed = {"hsq/node/procs.py"}
    offenders = []
    for path in ROOT.glob("hsq/**/*.py"):
        rel = str(path.relative_to(ROOT))
        if rel in allowed or rel.startswith("hsq/store/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{rel}: {n}" for n in names if n.split(".")[0] in ("redis", "rq")]
    assert offenders == []


def test_unknown_run_names_and_ids_with_a_trailing_newline_are_refused(redis_url: str) -> None:
    """Minor: `$` let "name\\n" through SAFE_ID_RE and RUN_NAME_RE; fullmatch does not."""
    from hsq.dataset.jsonl import check_sample_id
    from hsq.errors import DatasetError
    from hsq.keys import RunKeys

    with pytest.raises(DatasetError):
        check_sample_id("s1\n")
    with pytest.raises(ValueError):
        RunKeys("run\n")
    with pytest.raises(ConfigError):
        RunStore(connect(redis_url), "run\n")


def test_the_exporter_binds_loopback_unless_told_otherwise(tmp_path: Path, redis_url: str) -> None:
    """Minor: the exporter bound 0.0.0.0 by default; now 127.0.0.1 unless --metrics-host."""
    import httpx
    import psutil

    from hsq.node.procs import ManagedProcess, free_port, hsq_command
    from tests.helpers import wait_until

    port = free_port()
    proc = ManagedProcess(
        hsq_command("exporter", "--redis", redis_url, "--metrics-port", str(port)),
        tmp_path / "e.log",
    )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=60)
        listening = {
            c.laddr.ip
            for c in psutil.Process(proc.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
        assert listening == {"127.0.0.1"}
    finally:
        proc.stop()


def test_two_enqueues_started_together_queue_each_sample_once(
    tmp_path: Path, redis_url: str
) -> None:
    """Two enqueues at once, with real processes: two `hsq enqueue`s of one run started at
    the same moment with different --out. Old code: both succeeded, every sample was queued
    twice and one --out was silently ignored. Now exactly one succeeds; the other exits 2 and
    says why."""
    import subprocess

    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 20000, seed=9, min_len=4, max_len=8)

    def start(out: str) -> subprocess.Popen[str]:
        argv = hsq_argv("enqueue", str(ds), "--run", "race")
        argv += ["--out", str(tmp_path / out), "--redis", redis_url, "--no-progress"]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [start("a"), start("b")]
    results = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        results.append((p.returncode, err))
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    assert "another `hsq enqueue`" in loser or "exists with other settings" in loser, loser
    st = store(redis_url, "race")
    cfg = st.require_config()
    winner = "a" if results[0][0] == 0 else "b"
    assert cfg.out == str(tmp_path / winner)
    status = run_status(st)
    assert (status.queued, status.missing) == (20000, 0)
    assert st.queue_lengths()["main"] == 20000 // cfg.chunk_size


def test_a_purge_while_a_real_worker_runs_leaves_no_key_behind(
    tmp_path: Path, redis_url: str, server_factory: Any
) -> None:
    """The purge fence with real processes: `hsq purge` while a worker is extracting. Old code: the
    worker's next done mark recreated the purged done hash. Now its writes are refused
    (RunChangedError) and, once it is stopped, no key of the run exists."""
    import httpx

    from tests.helpers import start_worker, wait_until

    server = server_factory(name="purgesrv").wait_ready()
    rules = [{"mode": "slow", "seconds": 0.2, "prob": 1.0}]
    httpx.post(server.url + "/admin/faults", json={"rules": rules}).raise_for_status()
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 40, seed=12, min_len=4, max_len=16)
    enqueue(ds, "purged", tmp_path / "out", redis_url, "--chunk-size", "4")
    st = store(redis_url, "purged")
    w = start_worker(tmp_path, "purged", server, redis_url, name="pw")
    try:
        wait_until(lambda: st.count(st.keys.done) >= 2, timeout=120)
        assert hsq("purge", "--run", "purged", "--yes", "--redis", redis_url).returncode == 0
        # The worker holds a chunk and keeps extracting it; wait until it was refused.
        wait_until(lambda: "was purged or re-created" in w.log_path.read_text(), timeout=120)
    finally:
        w.stop()
        httpx.delete(server.url + "/admin/faults").raise_for_status()
    assert st.client.keys("hsq:run:purged:*") == []
    assert st.client.keys("rq:queue:hsq-purged*") == []
    assert "purged" not in list_runs(st.client)


def test_a_run_created_before_generations_gets_one_and_keeps_working(
    tmp_path: Path, redis_url: str
) -> None:
    """Upgrade path of the purge fence: a config without `generation` (written by older hsq)
    is given one on first read, so its workers' writes are not refused forever."""
    st = fresh_run(redis_url, "legacy", tmp_path)
    st.client.hdel(st.keys.config, "generation")
    old = RunStore(connect(redis_url), "legacy")
    other = RunStore(connect(redis_url), "legacy")
    assert old.require_config().generation == other.require_config().generation is not None
    assert old.mark_done("a", manifest("a"))
