"""The null-model server, the worker's copy path against it, and a woken worker that must
not replace a file another worker redid. Real
processes: redis-server, null servers, `hsq worker`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from hsq.dump.format import fingerprint
from hsq.dump.read import Expected, read_dump
from hsq.outputs.check import checksum_matches, file_checksum
from hsq.outputs.format import open_output
from hsq.producer.synthetic import write_synthetic
from hsq.stfile.integrity import Digest
from tests.helpers import enqueue, hsq, log_events, spawn_worker, store, wait_until
from tests.support.procs import NullServer

ROOT = Path(__file__).resolve().parent.parent


def null_server(base: Path, *args: str) -> NullServer:
    return NullServer(base / "dumps", base / "server.log", args=["--shape", "tiny", *args])


def test_null_server_dumps_pass_the_protocol_checks(tmp_path: Path) -> None:
    """One request: the dump carries the rid, fingerprint, count and shape the worker
    checks, and the marker announces the identity every dump carries."""
    srv = null_server(tmp_path, "--max-tokens", "64")
    with srv:
        srv.wait_ready()
        ids = list(range(1, 41))
        r = httpx.post(
            srv.url + "/generate",
            json={"input_ids": ids, "rid": "r-1", "sampling_params": {"max_new_tokens": 0}},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 40
        dump = read_dump(srv.dump_dir / "req_0", Expected("r-1", fingerprint(ids), 40))
        assert list(dump.aux_hidden_states.shape) == [40, 3 * 64]
        marker = json.loads((srv.dump_dir / "hsq-ready.json").read_text())
        assert (
            marker["model"] == json.loads((srv.dump_dir / "req_0/meta.json").read_text())["model"]
        )
        too_long = httpx.post(srv.url + "/generate", json={"input_ids": [1] * 65, "rid": "x"})
        assert too_long.status_code == 400
        info = httpx.get(srv.url + "/server_info").json()
        assert info["requests_served"] == 1 and info["first_request_unix"] is not None


@pytest.mark.parametrize("store_dtype", ["bf16", "fp8-e4m3"])
def test_a_burst_worker_against_the_null_server(
    tmp_path: Path, redis_url: str, store_dtype: str
) -> None:
    """Every sample done, every file verified deep (xxh3 checksums), and the worker logs
    the steps the ceiling benchmark reports."""
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 10, seed=3, min_len=8, max_len=300)
    out = tmp_path / "out"
    enqueue(ds, "nul", out, redis_url, "--store-dtype", store_dtype)
    srv = null_server(tmp_path, "--max-tokens", "512")
    with srv:
        srv.wait_ready()
        w = spawn_worker("nul", srv.url, srv.dump_dir, redis_url, tmp_path / "w.log", "--burst")
        assert w.proc.wait(120) == 0, w.log_tail()
    done = log_events(tmp_path / "w.log", "sample_done")
    assert len(done) == 10
    steps = {"validate_ms", "read_ms", "checksum_ms", "write_ms", "fsync_ms", "mark_ms"}
    assert steps <= set(done[0])
    assert ("finite_ms" if store_dtype == "bf16" else "quantize_ms") in done[0]
    st = store(redis_url, "nul")
    entries = dict(st.iter_manifest())
    assert len(entries) == 10
    for entry in entries.values():
        assert entry is not None and entry.checksum.startswith("xxh3:")
    res = hsq("verify", "--run", "nul", "--deep", "--redis", redis_url)
    assert res.returncode == 0, res.stdout + res.stderr


def test_verify_reads_crc32_manifests_of_older_files(tmp_path: Path) -> None:
    """Files written before xxh3 carry crc32 in their manifest entry: still verified."""
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(5000))
    old = file_checksum(p, "crc32")
    assert old.startswith("crc32:") and checksum_matches(p, old)
    assert checksum_matches(p, file_checksum(p)) and file_checksum(p).startswith("xxh3:")
    d = Digest("crc32")
    d.update(b"other")
    assert not checksum_matches(p, d.text) and not checksum_matches(p, "md5:00")


@pytest.mark.realproc
def test_a_woken_worker_does_not_replace_a_file_redone_by_another(
    tmp_path: Path, redis_url: str
) -> None:
    """Worker A holds a sample whose dump it has and whose answer is
    late; A is SIGSTOPped past its heartbeat; worker B (another server, other values, the
    same model) redoes the sample and marks it done. A is continued: it must not rename
    its file over B's, so the file on disk is still the one B's manifest entry names."""
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 1, seed=5, min_len=200, max_len=200)
    out = tmp_path / "out"
    enqueue(ds, "woke", out, redis_url)
    st = store(redis_url, "woke")
    fast = ["--heartbeat-interval", "0.5", "--reap-interval", "0.5"]
    sa = null_server(tmp_path / "a", "--seed", "1", "--answer-delay-s", "4")
    sb = null_server(tmp_path / "b", "--seed", "2")
    a = b = None
    try:
        sa.wait_ready()
        sb.wait_ready()
        a = spawn_worker(
            "woke", sa.url, sa.dump_dir, redis_url, tmp_path / "a.log", "--burst", *fast
        )
        wait_until(lambda: httpx.get(sa.url + "/server_info").json()["requests_served"] == 1, 60)
        a.signal(signal.SIGSTOP)  # the dump is written; the answer comes in 4 s
        b = spawn_worker(
            "woke", sb.url, sb.dump_dir, redis_url, tmp_path / "b.log", "--burst", *fast
        )
        # A's heartbeat expires (10 s), B's reaper takes A's job back, B does the sample.
        assert b.proc.wait(90) == 0, b.log_tail()
        entry = st.get_manifest(next(iter(dict(st.iter_manifest()))))
        assert entry is not None
        assert entry.worker == log_events(tmp_path / "b.log", "worker_started")[0]["worker"]
        path = out / "woke" / entry.path
        assert checksum_matches(path, entry.checksum)
        b_bytes = path.read_bytes()
        a.signal(signal.SIGCONT)  # A gets its answer, copies its dump, then finishes
        assert a.proc.wait(60) == 0, a.log_tail()
    finally:
        for p in (a, b):
            if p is not None:
                p.signal(signal.SIGCONT)
                p.stop()
        sa.stop()
        sb.stop()
    assert path.read_bytes() == b_bytes and checksum_matches(path, entry.checksum)
    assert log_events(tmp_path / "a.log", "sample_done_elsewhere")
    assert not log_events(tmp_path / "a.log", "sample_done")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left behind
    assert open_output(path).num_tokens == 200
    res = hsq("verify", "--run", "woke", "--deep", "--redis", redis_url)
    assert res.returncode == 0, res.stdout + res.stderr


def test_make_bench_runs_from_a_plain_checkout() -> None:
    """`bench/pipeline.py` imported `bench.disk` and failed with
    ModuleNotFoundError outside the source tree's sys.path; `make bench` runs the benchmarks
    as modules from the repository root, and bench-smoke (CI) runs them at tiny sizes."""
    make = (ROOT / "Makefile").read_text()
    assert "-m bench.pipeline" in make and "-m bench.ceiling" in make and "bench-smoke:" in make
    assert "make bench-smoke" in (ROOT / ".ci/run").read_text()
    for module in ("bench.pipeline", "bench.ceiling", "bench.disk"):
        res = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        assert res.returncode == 0, res.stderr


def test_the_lease_breaks_on_any_gap_longer_than_half_the_ttl() -> None:
    """Samples skip the done look only while heartbeats went out without a break: once
    a gap (a SIGSTOP) may have let a reaper take the jobs, every sample looks."""
    import time

    from hsq.workers.persist.stage import Lease

    lease = Lease(10.0)
    assert not lease.held()  # nothing sent yet
    now = time.monotonic()
    lease.renewed(now - 4.0)
    lease.renewed(now)
    assert lease.held()
    stale = Lease(10.0)
    stale.renewed(now - 6.0)
    assert not stale.held()  # the last heartbeat is too old: the key may be gone
    lease.renewed(now + 20.0)  # woken after 20 s: renewed again, but the break stays
    assert not lease.held()
