"""Protocol v2 end to end with K > 1 requests in flight: real redis-server, real reference
servers, real `hsq worker` processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from hsq.engines.reference.model import load_model
from hsq.node.procs import ManagedProcess
from hsq.ops import run_status, verify
from hsq.producer.synthetic import write_synthetic
from tests.conftest import generate
from tests.helpers import enqueue, hsq, hsq_process, log_events, start_worker, store, wait_until
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
K = "4"


def faults(server: ReferenceServer, *rules: dict[str, object]) -> None:
    httpx.post(server.url + "/admin/faults", json={"rules": list(rules)}).raise_for_status()


@pytest.fixture(scope="module")
def server(server_factory: Factory) -> ReferenceServer:
    return server_factory(name="k_srv").wait_ready()


@pytest.fixture
def fresh(server: ReferenceServer) -> ReferenceServer:
    httpx.delete(server.url + "/admin/faults").raise_for_status()
    return server


def dataset(tmp_path: Path, n: int, seed: int, max_len: int = 48) -> Path:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, n, seed=seed, min_len=4, max_len=max_len)
    return ds


def close_to_single(batched: torch.Tensor, single: torch.Tensor) -> bool:
    """docs/dump-protocol.md: per token, cosine >= 0.999 and max abs error <= 1% of the
    row's norm (exact for today's one-forward-at-a-time server)."""
    a, b = batched.float(), single.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    err = (a - b).abs().amax(dim=-1)
    return bool((cos >= 0.999).all() and (err <= 0.01 * b.norm(dim=-1) + 1e-6).all())


def test_outputs_with_eight_in_flight_equal_a_single_request_forward(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = dataset(tmp_path, 24, seed=31, max_len=120)
    out = tmp_path / "out"
    enqueue(ds, "k8", out, redis_url, "--chunk-size", "3")
    w = start_worker(tmp_path, "k8", fresh, redis_url, "--burst", "--inflight", "8")
    assert w.proc.wait(120) == 0, w.log_tail()
    st = store(redis_url, "k8")
    assert st.count(st.keys.done) == 24 and st.count(st.keys.dead) == 0
    torch.set_num_threads(2)
    model = load_model(
        "tiny", device="cpu", dtype=torch.float32, dump_dtype=torch.bfloat16, layers=None
    )
    for line in ds.read_text().splitlines():
        sample = json.loads(line)
        entry = st.get_manifest(sample["id"])
        assert entry is not None
        t = load_file(str(out / "k8" / entry.path))
        direct = model.forward(sample["input_ids"])
        assert t["input_ids"].tolist() == sample["input_ids"]
        assert close_to_single(t["aux_hidden_states"], direct.aux)
        assert close_to_single(t["last_hidden_state"], direct.last)
    assert verify(st, out / "k8", deep=True).ok == 24
    started = log_events(w.log_path, "worker_started")[0]
    assert started["inflight"] == 8


def test_leftover_and_unknown_rid_dumps_are_removed_and_counted(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    srv = server_factory("--warmup", "3", name="k_warm").wait_ready()  # 3 leftovers
    ds = dataset(tmp_path, 20, seed=32)
    enqueue(ds, "unk", tmp_path / "out", redis_url, "--chunk-size", "4")
    st = store(redis_url, "unk")
    w = start_worker(tmp_path, "unk", srv, redis_url, "--inflight", K)
    try:
        wait_until(lambda: bool(log_events(w.log_path, "worker_started")), 60)
        assert log_events(w.log_path, "worker_started")[0]["cleared_dumps"] == 3
        # Someone else's request (a health check, a warm-up, an operator's curl).
        assert generate(srv.url, [5, 6, 7, 8], "intruder").status_code == 200
        wait_until(lambda: st.count(st.keys.done) == 20, 90)
        wait_until(lambda: bool(log_events(w.log_path, "dump_discarded")), 30)
        [ev] = log_events(w.log_path, "dump_discarded")
        assert ev["why"] == "unknown_rid" and ev["rid"] == "intruder"

        def shown() -> bool:
            workers = run_status(st).workers
            return bool(workers) and workers[0].dumps_discarded == 1

        wait_until(shown, 30)
        text = hsq("status", "--run", "unk", "--redis", redis_url).stdout
        assert "dumps discarded 1" in text
    finally:
        w.stop()
    assert st.count(st.keys.dead) == 0
    srv.stop()


def test_a_late_dump_after_a_timeout_fails_no_later_sample(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    """One late dump used to send 6 of the next 8 samples to the dead letter."""
    ds = dataset(tmp_path, 24, seed=33)
    enqueue(ds, "late", tmp_path / "out", redis_url, "--chunk-size", "4", "--max-attempts", "1")
    faults(fresh, {"mode": "slow", "seconds": 3, "times": 1})
    w = start_worker(
        tmp_path, "late", fresh, redis_url, "--burst", "--inflight", K, "--request-timeout", "1"
    )
    assert w.proc.wait(120) == 0, w.log_tail()
    st = store(redis_url, "late")
    assert st.count(st.keys.done) == 24 and st.count(st.keys.dead) == 0
    # The timed-out request's dump landed later and was thrown away, nothing else failed.
    assert not log_events(w.log_path, "sample_retry")
    handed = log_events(w.log_path, "sample_handed_back")
    assert handed and {e["reason"] for e in handed} == {"server_crash"}


def test_late_dump_is_discarded_as_late(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = dataset(tmp_path, 12, seed=34)
    enqueue(ds, "late2", tmp_path / "out", redis_url, "--chunk-size", "4")
    faults(fresh, {"mode": "slow", "seconds": 2, "times": 1})
    w = start_worker(tmp_path, "late2", fresh, redis_url, "--inflight", K, "--request-timeout", "1")
    st = store(redis_url, "late2")
    try:
        wait_until(lambda: st.count(st.keys.done) == 12, 90)

        def whys() -> set[object]:
            return {e["why"] for e in log_events(w.log_path, "dump_discarded")}

        wait_until(lambda: "late" in whys(), 30)
        # The server is shared by this module's tests: a dump a previous test's worker
        # gave up on can land here too, and is (rightly) an unknown rid to this worker.
        assert whys() <= {"late", "unknown_rid"}
    finally:
        w.stop()
    assert st.count(st.keys.dead) == 0


def test_two_dumps_for_one_rid_fail_that_sample_with_multiple_dumps(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = dataset(tmp_path, 16, seed=35)
    enqueue(ds, "split", tmp_path / "out", redis_url, "--chunk-size", "4")
    faults(fresh, {"mode": "split", "times": 1})
    w = start_worker(tmp_path, "split", fresh, redis_url, "--burst", "--inflight", K)
    assert w.proc.wait(120) == 0, w.log_tail()
    st = store(redis_url, "split")
    assert st.count(st.keys.done) == 16 and st.count(st.keys.dead) == 0
    retried = [e["reason"] for e in log_events(w.log_path, "sample_retry")]
    assert retried and set(retried) == {"multiple_dumps"}
    assert verify(st, tmp_path / "out" / "split", deep=True).ok == 16


@pytest.mark.realproc
def test_a_server_killed_with_k_in_flight_sends_none_to_the_dead_letter(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    srv = server_factory("--fault", "slow:seconds=0.3", name="k_kill").wait_ready()
    ds = dataset(tmp_path, 40, seed=36)
    enqueue(ds, "skill", tmp_path / "out", redis_url, "--chunk-size", "4", "--max-attempts", "1")
    st = store(redis_url, "skill")
    w = start_worker(tmp_path, "skill", srv, redis_url, "--burst", "--inflight", K)
    wait_until(lambda: st.count(st.keys.done) >= 8, 90, interval=0.05)
    srv.signal(signal.SIGKILL)  # every request takes 0.3 s: K of them are in flight
    srv.proc.wait(10)
    wait_until(lambda: bool(log_events(w.log_path, "waiting_for_server")), 60, interval=0.05)
    assert w.alive()
    again = ReferenceServer(srv.dump_dir, srv.log_path, port=srv.port, args=["--threads", "2"])
    try:
        again.wait_ready()
        assert w.proc.wait(120) == 0, w.log_tail()
    finally:
        again.stop()
    assert st.count(st.keys.dead) == 0 and st.count(st.keys.done) == 40
    assert log_events(w.log_path, "waiting_for_server")
    assert len(log_events(w.log_path, "sample_handed_back")) >= 2  # more than one in flight
    assert verify(st, tmp_path / "out" / "skill", deep=True).ok == 40


@pytest.mark.realproc
def test_a_worker_sigkilled_with_k_in_flight_redoes_at_most_those(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    srv = server_factory("--fault", "slow:seconds=0.2", name="k_wkill").wait_ready()
    ds = dataset(tmp_path, 40, seed=37)
    out = tmp_path / "out"
    enqueue(ds, "wkill", out, redis_url, "--chunk-size", "4")
    st = store(redis_url, "wkill")
    a = start_worker(tmp_path, "wkill", srv, redis_url, "--inflight", K, name="victim")
    wait_until(lambda: st.count(st.keys.done) >= 8, 90, interval=0.05)
    a.signal(signal.SIGKILL)
    a.proc.wait(10)
    done_before = st.count(st.keys.done)
    b = start_worker(tmp_path, "wkill", srv, redis_url, "--burst", "--inflight", K, name="rescuer")
    assert b.proc.wait(120) == 0, b.log_tail()
    srv.stop()
    assert st.count(st.keys.done) == 40 and st.count(st.keys.dead) == 0
    events = log_events(a.log_path, "sample_done") + log_events(b.log_path, "sample_done")
    firsts = Counter(str(e["sample"]) for e in events if e["first"])
    # Marked done once each. A worker logs `sample_done` after its batch's marks, so the
    # SIGKILL may land between the two: a sample the victim marked can lack its line (seen:
    # 6 of 40). The rescuer ends cleanly and logs every sample it marked.
    assert set(firsts.values()) == {1}
    assert len(firsts) >= 40 - done_before
    rescued = {str(e["sample"]) for e in log_events(b.log_path, "sample_done")}
    assert len(rescued) == 40 - done_before  # nothing done before the kill was redone
    files = list((out / "wkill").rglob("*"))
    assert not [p for p in files if p.name.endswith(".tmp")]
    assert len([p for p in files if p.suffix == ".safetensors"]) == 40
    assert verify(st, out / "wkill", deep=True).ok == 40


@pytest.mark.realproc
def test_a_shared_dump_dir_is_refused_before_anything_is_touched(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    """The worker chmodded a 1777 dir to 0700 and emptied it, even for a run
    that did not exist."""
    shared = tmp_path / "shm"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "req_7").mkdir()  # someone else's
    args = ["--server", fresh.url, "--dump-dir", str(shared), "--redis", redis_url]
    gone = hsq_process("worker", "--run", "nope", *args)
    assert gone.returncode == 2 and "does not exist" in gone.stderr
    ds = dataset(tmp_path, 2, seed=38)
    enqueue(ds, "shared", tmp_path / "out", redis_url)
    refused = hsq_process("worker", "--run", "shared", *args)
    assert refused.returncode == 2 and "--dump-dir-force" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and (shared / "req_7").is_dir()
    assert not (tmp_path / "never").exists()
    missing = hsq_process("worker", "--run", "nope", "--server", fresh.url, "--dump-dir",
                  str(tmp_path / "never"), "--redis", redis_url)  # fmt: skip
    assert missing.returncode == 2 and not (tmp_path / "never").exists()


@pytest.mark.realproc
def test_a_mistyped_dump_dir_creates_nothing(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    """For a run that exists, `--dump-dir /nonexistent/dir` made the
    directory, its .hsq-worker.lock and .hsq-staging/, then exited 2 (no readiness marker
    there). Now a missing dump dir is refused first, named, and nothing is created."""
    enqueue(dataset(tmp_path, 2, seed=40), "typo", tmp_path / "out", redis_url)
    typo = tmp_path / "nonexistent" / "dir"
    proc = hsq_process("worker", "--run", "typo", "--server", fresh.url, "--dump-dir", str(typo),
               "--redis", redis_url, "--burst")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"--dump-dir {typo} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "nonexistent").exists()
    st = store(redis_url, "typo")
    assert st.count(st.keys.done) == 0 and len(st.outstanding_samples()) == 2


# `hsq worker` with a bug planted in its dump matcher: after a few dumps were matched, every
# poll with requests in flight raises (as an unforeseen dump-dir state could make it).
MATCHER_BUG = """
import sys
from hsq.workers.send import dispatch

real, decided = dispatch.RidMatcher.poll, [0]


def poll(self, now):
    if decided[0] >= 4 and self.wanted:
        raise KeyError("planted: a bug in the dump matcher")
    found = real(self, now)
    decided[0] += len(found[0])
    return found


dispatch.RidMatcher.poll = poll
from hsq.cli.main import main

main()
"""


def test_a_bug_in_the_dump_matcher_stops_the_worker_loudly_and_charges_no_sample(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    """The dispatcher logged any exception from the matcher and polled on, so every
    request in flight timed out as no_dump and, attempt after attempt, ended in the dead
    letter. Now the worker hands its work back, logs why and exits 1; nothing is retried or
    dead, and the next worker finishes the run."""
    n = 24
    ds = dataset(tmp_path, n, seed=39)
    enqueue(ds, "mbug", tmp_path / "out", redis_url, "--chunk-size", "4", "--max-attempts", "1")
    faults(fresh, {"mode": "slow", "seconds": 0.05, "prob": 1.0})  # K requests in flight
    argv = [sys.executable, "-c", MATCHER_BUG, "--log-format", "json", "worker", "--run", "mbug",
            "--server", fresh.url, "--dump-dir", str(fresh.dump_dir), "--burst",
            "--inflight", K, "--dump-timeout", "1", "--name", "buggy"]  # fmt: skip
    bad = ManagedProcess(argv, tmp_path / "buggy.log", env={"HSQ_REDIS_URL": redis_url})
    try:
        assert bad.proc.wait(120) == 1, bad.log_tail()
    finally:
        bad.stop()
    st = store(redis_url, "mbug")
    status = run_status(st)
    assert status.dead == 0 and status.retry == 0 and status.in_progress == 0
    assert status.done < n and status.done + status.queued == n  # handed back, not lost
    assert not log_events(bad.log_path, "sample_retry") + log_events(bad.log_path, "sample_dead")
    assert log_events(bad.log_path, "dump_matcher_failed")
    assert log_events(bad.log_path, "internal_error_stopping")
    assert log_events(bad.log_path, "job_handed_back")
    assert "error: " in bad.log_path.read_text() and "planted" in bad.log_tail(5)
    httpx.delete(fresh.url + "/admin/faults").raise_for_status()
    good = start_worker(tmp_path, "mbug", fresh, redis_url, "--burst", "--inflight", K)
    assert good.proc.wait(120) == 0, good.log_tail()
    assert st.count(st.keys.done) == n and st.count(st.keys.dead) == 0
    assert verify(st, tmp_path / "out" / "mbug", deep=True).ok == n
