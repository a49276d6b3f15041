"""The queue end to end: real redis-server, real reference servers, real worker processes."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsq.dataset.jsonl import IndexEntry
from hsq.dump.format import fingerprint
from hsq.engines.reference.model import load_model
from hsq.ops import verify
from hsq.producer.synthetic import write_synthetic
from tests.helpers import enqueue, hsq, hsq_process, log_events, start_worker, store, wait_until
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]


def enqueued(stdout: str) -> int:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("enqueued"))
    return int(line.split()[1])


@pytest.fixture(scope="module")
def server(server_factory: Factory) -> ReferenceServer:
    return server_factory("--warmup", "2", name="qsrv").wait_ready()


@pytest.fixture
def fresh(server: ReferenceServer) -> ReferenceServer:
    httpx.delete(server.url + "/admin/faults").raise_for_status()
    return server


def test_end_to_end_outputs_equal_a_direct_computation(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 24, seed=3, min_len=4, max_len=200)
    out = tmp_path / "out"
    assert enqueued(enqueue(ds, "e2e", out, redis_url, "--chunk-size", "5")) == 24
    w = start_worker(tmp_path, "e2e", fresh, redis_url, "--burst")
    assert w.proc.wait(120) == 0, w.log_tail()

    st = store(redis_url, "e2e")
    assert st.count(st.keys.done) == 24 and st.count(st.keys.dead) == 0
    torch.set_num_threads(2)
    model = load_model(
        "tiny", device="cpu", dtype=torch.float32, dump_dtype=torch.bfloat16, layers=None
    )
    files = sorted((out / "e2e").rglob("*.safetensors"))
    assert len(files) == 24
    assert not [p for p in (out / "e2e").rglob("*") if p.name.endswith(".tmp")]
    for line in ds.read_text().splitlines():
        sample = json.loads(line)
        entry = st.get_manifest(sample["id"])
        assert entry is not None
        path = out / "e2e" / entry.path
        t = load_file(str(path))
        direct = model.forward(sample["input_ids"])
        assert t["input_ids"].tolist() == sample["input_ids"]
        assert t["loss_mask"].tolist() == sample["loss_mask"]
        assert torch.equal(t["aux_hidden_states"], direct.aux)
        assert torch.equal(t["last_hidden_state"], direct.last)
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert meta["sample_id"] == sample["id"] and meta["run"] == "e2e"
        assert json.loads(meta["layer_ids"]) == [2, 4, 5]
        assert meta["model_id"] == model.identity.model_id
        assert entry.num_tokens == len(sample["input_ids"]) == int(meta["num_tokens"])
        assert entry.bytes == path.stat().st_size
    # The run pinned the model and layers the first dump showed.
    cfg = st.require_config()
    assert cfg.model_id == model.identity.model_id and cfg.layer_ids == [2, 4, 5]
    assert verify(st, out / "e2e", deep=True).ok == 24
    # Structured per-sample logs with timings.
    ev = log_events(w.log_path, "sample_done")
    assert len(ev) == 24 and {"request_ms", "wait_ms", "persist_ms"} <= set(ev[0])


def test_enqueue_twice_is_a_no_op_and_a_partial_run_enqueues_the_rest(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 10, seed=1, min_len=4, max_len=32)
    out = tmp_path / "out"
    assert enqueued(enqueue(ds, "idem", out, redis_url)) == 10
    second = enqueue(ds, "idem", out, redis_url)
    assert enqueued(second) == 0 and "already queued  10" in second
    w = start_worker(tmp_path, "idem", fresh, redis_url, "--burst", name="w1")
    assert w.proc.wait(120) == 0, w.log_tail()
    assert enqueued(enqueue(ds, "idem", out, redis_url)) == 0
    # More samples arrive: only they are enqueued.
    more = tmp_path / "more.jsonl"
    write_synthetic(more, 15, seed=1, min_len=4, max_len=32)  # the first 10 are the same
    ds.write_text(more.read_text())
    third = enqueue(ds, "idem", out, redis_url)
    assert enqueued(third) == 5 and "already done    10" in third


def test_enqueue_refuses_to_change_a_runs_output_dir(tmp_path: Path, redis_url: str) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 3, seed=1, min_len=4, max_len=8)
    enqueue(ds, "cfg", tmp_path / "a", redis_url)
    proc = hsq(
        "enqueue", str(ds), "--run", "cfg", "--out", str(tmp_path / "b"), "--redis", redis_url
    )
    assert proc.returncode == 2 and "exists with other settings" in proc.stderr


def test_two_workers_on_two_servers_write_each_sample_once(
    tmp_path: Path, fresh: ReferenceServer, server_factory: Factory, redis_url: str
) -> None:
    other = server_factory(name="qsrv2").wait_ready()
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 40, seed=5, min_len=4, max_len=64)
    out = tmp_path / "out"
    enqueue(ds, "two", out, redis_url, "--chunk-size", "3")
    enqueue(ds, "two", out, redis_url, "--chunk-size", "3")  # twice: still each once
    # Worker a's server answers slowly until worker b has done a sample, so a cannot drain
    # the queue while b is still starting (it did on a loaded CI machine), and b starts only
    # once a holds work: both write samples whatever the start-up times.
    slow = [{"mode": "slow", "seconds": 1.0, "prob": 1.0}]
    httpx.post(fresh.url + "/admin/faults", json={"rules": slow}).raise_for_status()
    st = store(redis_url, "two")
    chunks = st.queue_lengths()["main"]
    w1 = start_worker(tmp_path, "two", fresh, redis_url, "--burst", name="a")
    wait_until(lambda: st.queue_lengths()["main"] < chunks, 60, interval=0.05)  # a holds work
    w2 = start_worker(tmp_path, "two", other, redis_url, "--burst", name="b")
    wait_until(lambda: bool(log_events(w2.log_path, "sample_done")), 60)
    httpx.delete(fresh.url + "/admin/faults").raise_for_status()
    assert w1.proc.wait(120) == 0 and w2.proc.wait(120) == 0
    done_events = log_events(w1.log_path, "sample_done") + log_events(w2.log_path, "sample_done")
    per_sample = Counter(str(e["sample"]) for e in done_events)
    assert len(per_sample) == 40 and set(per_sample.values()) == {1}
    assert log_events(w1.log_path, "sample_done") and log_events(w2.log_path, "sample_done")
    assert st.count(st.keys.done) == 40
    assert len(list((out / "two").rglob("*.safetensors"))) == 40
    other.stop()


def test_bad_dataset_lines_reach_the_dead_letter_and_strict_refuses(
    tmp_path: Path, redis_url: str
) -> None:
    ds = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"id": "ok1", "input_ids": [1, 2, 3]}),
        "{not json",
        json.dumps({"id": "ok1", "input_ids": [4]}),
        json.dumps({"id": "empty", "input_ids": []}),
        json.dumps({"id": "../../etc/passwd", "input_ids": [1]}),
        json.dumps({"id": "mask", "input_ids": [1, 2], "loss_mask": [1]}),
        json.dumps({"id": 7, "input_ids": [5, 6]}),
        "",
    ]
    ds.write_text("\n".join(lines) + "\n")
    strict = hsq(
        "enqueue",
        str(ds),
        "--run",
        "strict",
        "--out",
        str(tmp_path / "o"),
        "--redis",
        redis_url,
        "--strict",
        "--no-progress",
    )
    assert strict.returncode == 1 and "--strict" in strict.stderr
    assert store(redis_url, "strict").load_config() is None  # nothing recorded

    stdout = enqueue(ds, "lax", tmp_path / "o", redis_url)
    assert enqueued(stdout) == 2  # ok1 and 7
    dead = store(redis_url, "lax").dead_entries()
    assert {k: v["reason"] for k, v in dead.items()} == {
        "line:2": "malformed_json",
        "line:3": "duplicate_id",
        "line:4": "empty_input_ids",
        "line:5": "unsafe_id",
        "line:6": "bad_loss_mask",
    }


def test_transient_faults_succeed_on_retry_and_permanent_ones_reach_the_dead_letter(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 12, seed=9, min_len=6, max_len=40)
    samples = [json.loads(x) for x in ds.read_text().splitlines()]
    poison = samples[4]
    rules = [
        {"mode": "wrong_count", "fingerprint": fingerprint(poison["input_ids"])},
        *(
            {"mode": m, "times": 1}
            for m in ("stale", "split", "no_done", "wrong_count", "nan", "corrupt", "http_500")
        ),
    ]
    httpx.post(fresh.url + "/admin/faults", json={"rules": rules}).raise_for_status()
    out = tmp_path / "out"
    enqueue(ds, "faults", out, redis_url, "--chunk-size", "4", "--max-attempts", "3")
    w = start_worker(tmp_path, "faults", fresh, redis_url, "--burst", "--dump-timeout", "1.5")
    assert w.proc.wait(180) == 0, w.log_tail()

    st = store(redis_url, "faults")
    dead = st.dead_entries()
    assert list(dead) == [poison["id"]]
    assert dead[poison["id"]]["reason"] == "wrong_length"
    assert dead[poison["id"]]["attempts"] == 3
    assert st.count(st.keys.done) == 11
    retried = Counter(str(e["reason"]) for e in log_events(w.log_path, "sample_retry"))
    for reason in (
        "stale_dump",
        "multiple_dumps",
        "incomplete_dump",
        "wrong_length",
        "non_finite",
        "corrupt_dump",
        "server_error",
    ):
        assert retried[reason] >= 1, retried
    # Nothing wrong was saved: every output is valid and none exists for the poison sample.
    report = verify(st, out / "faults", deep=True)
    assert report.ok == 11 and not report.problems
    names = {p.stem for p in (out / "faults").rglob("*.safetensors")}
    assert poison["id"] not in names and len(names) == 11


@pytest.mark.realproc
def test_kill_9_mid_sample_completes_within_60s(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 30, seed=11, min_len=4, max_len=48)
    out = tmp_path / "out"
    enqueue(ds, "kill", out, redis_url, "--chunk-size", "4")
    st = store(redis_url, "kill")
    # Every request is held in the server for a while, so the worker (K requests in flight)
    # is surely mid-sample, and mid-chunk, when it is killed.
    rules = [{"mode": "slow", "seconds": 0.3, "prob": 1.0}]
    httpx.post(fresh.url + "/admin/faults", json={"rules": rules}).raise_for_status()
    a = start_worker(tmp_path, "kill", fresh, redis_url, name="victim")
    wait_until(lambda: st.count(st.keys.done) >= 6, 60, interval=0.05)
    a.signal(signal.SIGKILL)
    a.proc.wait(10)
    killed_at = time.monotonic()
    assert st.count(st.keys.done) < 30
    b = start_worker(tmp_path, "kill", fresh, redis_url, "--burst", name="rescuer")
    assert b.proc.wait(120) == 0, b.log_tail()
    assert time.monotonic() - killed_at < 60
    assert st.count(st.keys.done) == 30 and st.count(st.keys.dead) == 0
    # Exactly once: one manifest entry, one file each, no torn or temp files.
    files = list((out / "kill").rglob("*"))
    assert not [p for p in files if p.name.endswith(".tmp")]
    assert len([p for p in files if p.suffix == ".safetensors"]) == 30
    assert verify(st, out / "kill", deep=True).ok == 30
    assert log_events(b.log_path, "recovered_dead_worker_jobs")


@pytest.mark.realproc
def test_server_restart_mid_run_sends_nothing_to_the_dead_letter(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    # Slow answers and two in flight: the run takes seconds, so the kill lands mid-run (done
    # marks are batched: with a fast server the count jumped from below 5 to 30 at once, the
    # worker finished before the kill and never waited for a server).
    srv = server_factory("--fault", "slow:seconds=0.2", name="restart").wait_ready()
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 30, seed=13, min_len=4, max_len=48)
    out = tmp_path / "out"
    enqueue(ds, "restart", out, redis_url, "--chunk-size", "4", "--max-attempts", "1")
    st = store(redis_url, "restart")
    # A dump timeout below the wait below: a request the server answered before the kill
    # waits for its dump (never written) that long before the worker sends again and finds
    # the server down (seen once under load, with the default 60 s).
    w = start_worker(tmp_path, "restart", srv, redis_url, "--burst", "--dump-timeout", "10",
                     "--inflight", "2")  # fmt: skip
    wait_until(lambda: st.count(st.keys.done) >= 5, 60, interval=0.05)
    srv.signal(signal.SIGKILL)
    srv.proc.wait(10)
    # The worker sees the server down and waits for it (an event, not a time).
    wait_until(lambda: bool(log_events(w.log_path, "waiting_for_server")), 60, interval=0.05)
    assert w.alive()
    again = ReferenceServer(srv.dump_dir, srv.log_path, port=srv.port, args=["--threads", "2"])
    try:
        again.wait_ready()
        assert w.proc.wait(120) == 0, w.log_tail()
    finally:
        again.stop()
    assert st.count(st.keys.dead) == 0
    assert st.count(st.keys.done) == 30
    assert log_events(w.log_path, "waiting_for_server")


@pytest.mark.realproc
def test_a_second_worker_on_the_same_dump_dir_is_refused(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 2, seed=1, min_len=4, max_len=8)
    enqueue(ds, "lock", tmp_path / "out", redis_url)
    a = start_worker(tmp_path, "lock", fresh, redis_url, name="holder")
    try:
        wait_until(lambda: bool(log_events(a.log_path, "worker_started")), 60)
        proc = hsq_process(
            "worker",
            "--run",
            "lock",
            "--server",
            fresh.url,
            "--dump-dir",
            str(fresh.dump_dir),
            "--redis",
            redis_url,
        )
        assert proc.returncode == 2
        assert "owned by another live worker" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        a.stop()


@pytest.mark.realproc
def test_sigterm_hands_back_and_loses_nothing(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 40, seed=2, min_len=4, max_len=64)
    rows = [json.loads(x) for x in ds.read_text().splitlines()]
    all_ids = {r["id"] for r in rows}
    # One sample can never finish: every dump of it is a token short, and it has attempts
    # enough to outlast the test. So the worker is still at work when SIGTERM lands, however
    # fast it gets through the other 39 (no race between them and the signal).
    stuck = rows[20]
    rule = {"mode": "wrong_count", "fingerprint": fingerprint(stuck["input_ids"])}
    httpx.post(fresh.url + "/admin/faults", json={"rules": [rule]}).raise_for_status()
    enqueue(
        ds, "term", tmp_path / "out", redis_url, "--chunk-size", "8", "--max-attempts", "100000"
    )
    st = store(redis_url, "term")
    w = start_worker(tmp_path, "term", fresh, redis_url)
    wait_until(lambda: st.count(st.keys.done) >= 3, 60, interval=0.05)
    w.signal(signal.SIGTERM)
    assert w.proc.wait(30) == 0
    done = st.done_among(list(all_ids))
    queued = st.outstanding_samples()
    assert all(place in ("main", "retry") for place in queued.values())  # nothing held
    assert 3 <= len(done) < 40 and stuck["id"] not in done
    assert all_ids - done <= set(queued)  # every unfinished sample is back in the queue
    assert st.dead_entries() == {}
    assert st.workers.worker_ids() == []


@pytest.mark.realproc
def test_worker_errors_are_plain_words_with_exit_codes(tmp_path: Path, redis_url: str) -> None:
    cases = [(redis_url, 2, "does not exist"), ("redis://127.0.0.1:1/0", 3, "cannot reach Redis")]
    for i, (url, code, message) in enumerate(cases):
        proc = hsq_process(
            "worker",
            "--run",
            "nope",
            "--server",
            "http://127.0.0.1:9",
            "--dump-dir",
            str(tmp_path / f"d{i}"),
            "--redis",
            url,
        )
        assert proc.returncode == code and message in proc.stderr
        assert "Traceback" not in proc.stderr


def test_index_entries_round_trip() -> None:
    e = IndexEntry(10, 20, 30, 4)
    assert IndexEntry.decode(e.encode()) == e
