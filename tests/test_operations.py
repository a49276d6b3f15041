"""Operating a run through the CLI, as a subprocess, against real Redis and a real run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from hsq.dump.format import fingerprint
from hsq.keys import rq_queue_key
from hsq.producer.synthetic import write_synthetic
from hsq.store import connect
from tests.helpers import enqueue, hsq, start_worker, store, wait_until
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
SUMMED = ("done", "queued", "in_progress", "retry", "dead", "missing")


@pytest.fixture(scope="module")
def server(server_factory: Factory) -> ReferenceServer:
    return server_factory(name="opsrv").wait_ready()


@pytest.fixture
def fresh(server: ReferenceServer) -> ReferenceServer:
    httpx.delete(server.url + "/admin/faults").raise_for_status()
    return server


def make_run(tmp: Path, run: str, redis_url: str, n: int, *extra: str) -> Path:
    ds = tmp / f"{run}.jsonl"
    write_synthetic(ds, n, seed=len(run), min_len=4, max_len=40)
    enqueue(ds, run, tmp / "out", redis_url, *extra)
    return ds


def status(run: str, redis_url: str, *extra: str) -> dict[str, Any]:
    proc = hsq("status", "--run", run, "--redis", redis_url, "--json", *extra, check=True)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def requeue(run: str, redis_url: str, *selection: str) -> str:
    return hsq("requeue", "--run", run, *selection, "--redis", redis_url, check=True).stdout


def burst(tmp: Path, run: str, srv: ReferenceServer, redis_url: str, name: str = "w") -> None:
    w = start_worker(tmp, run, srv, redis_url, "--burst", name=name)
    assert w.proc.wait(120) == 0, w.log_tail()


def test_a_wiped_queue_is_recovered_by_requeue_missing(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    make_run(tmp_path, "wipe", redis_url, 20, "--chunk-size", "3")
    connect(redis_url).delete(rq_queue_key("hsq-wipe"))  # the queue is lost
    st = status("wipe", redis_url)
    assert (st["total"], st["queued"], st["missing"], st["done"]) == (20, 0, 20, 0)
    assert sum(st[k] for k in SUMMED) == st["total"]
    dry = hsq(
        "requeue", "--run", "wipe", "--missing", "--dry-run", "--redis", redis_url, check=True
    )
    assert "would requeue 20" in dry.stdout
    assert status("wipe", redis_url)["missing"] == 20
    assert "requeued 20" in requeue("wipe", redis_url, "--missing")
    # Idempotent: nothing is missing any more.
    assert "requeued 0" in requeue("wipe", redis_url, "--missing")
    burst(tmp_path, "wipe", fresh, redis_url)
    st = status("wipe", redis_url)
    assert st["done"] == 20 and st["missing"] == 0


def test_verify_finds_truncated_and_bit_flipped_files_and_repairs_them(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    make_run(tmp_path, "vfy", redis_url, 10)
    burst(tmp_path, "vfy", fresh, redis_url)
    root = tmp_path / "out" / "vfy"
    files = sorted(root.rglob("*.safetensors"))
    truncated, flipped = files[0], files[1]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    raw = bytearray(flipped.read_bytes())
    raw[-3] ^= 0x40  # a bit in the tensor data: the header still reads fine
    flipped.write_bytes(bytes(raw))
    orphan = root / "zz" / "stray.safetensors"
    orphan.parent.mkdir()
    shutil.copy(files[2], orphan)

    shallow = hsq("verify", "--run", "vfy", "--redis", redis_url, "--no-progress")
    assert shallow.returncode == 1
    assert f"corrupt  {truncated.stem}" in shallow.stdout
    assert "orphan   zz/stray.safetensors" in shallow.stdout
    deep = hsq("verify", "--run", "vfy", "--redis", redis_url, "--deep", "--no-progress")
    assert deep.returncode == 1
    assert f"corrupt  {flipped.stem}: checksum mismatch" in deep.stdout
    assert "ok 8, missing 0, corrupt 2, orphans 1" in deep.stdout

    fix = hsq(
        "verify", "--run", "vfy", "--redis", redis_url, "--deep", "--requeue", "--no-progress"
    )
    assert "requeued 2 samples" in fix.stdout
    assert not truncated.exists() and not flipped.exists()
    st = status("vfy", redis_url)
    assert (st["done"], st["queued"]) == (8, 2)
    orphan.unlink()
    burst(tmp_path, "vfy", fresh, redis_url)
    final = hsq("verify", "--run", "vfy", "--redis", redis_url, "--deep", "--no-progress")
    assert final.returncode == 0 and "ok 10, missing 0, corrupt 0, orphans 0" in final.stdout
    st = status("vfy", redis_url)
    sizes = sum(p.stat().st_size for p in root.rglob("*.safetensors"))
    assert st["bytes_done"] == sizes  # totals stayed in step through undo and redo


def test_status_numbers_add_up_during_a_live_run(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    make_run(tmp_path, "live", redis_url, 40, "--chunk-size", "4")
    rules = [{"mode": "stale", "times": 3}, {"mode": "slow", "seconds": 0.15, "prob": 0.5}]
    httpx.post(fresh.url + "/admin/faults", json={"rules": rules}).raise_for_status()
    # A stale dump is caught when the request's own dump times out: keep that short.
    w = start_worker(tmp_path, "live", fresh, redis_url, "--dump-timeout", "3", name="live-w")
    snapshots = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = status("live", redis_url)
            snapshots.append(st)
            if st["done"] == 40:
                break
        else:
            pytest.fail(f"run did not finish: {snapshots[-1]}")
    finally:
        w.stop()
    for st in snapshots:
        assert set(st) >= {
            "run",
            "total",
            "done",
            "queued",
            "in_progress",
            "retry",
            "dead",
            "workers",
        }
        assert st["total"] == 40
        assert sum(st[k] for k in SUMMED) == 40, st
        assert st["missing"] == 0, st
    assert any(s["in_progress"] > 0 for s in snapshots)
    live = [s for s in snapshots if s["workers"]]
    assert live and live[-1]["workers"][0]["name"] == "live-w"
    assert live[-1]["workers"][0]["server"] == fresh.url
    assert any(s["tokens_per_s"] > 0 for s in live)
    text = hsq("status", "--run", "live", "--redis", redis_url, check=True).stdout
    assert "40/40 done (100.0%)" in text
    # Finished: no stale rate and "ETA -", an ETA of 0.
    assert "complete: 40 done, 0 dead" in text and "ETA" not in text
    assert status("live", redis_url)["eta_s"] == 0.0


def test_requeue_failed_by_reason_and_by_sample(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    ds = make_run(tmp_path, "rq", redis_url, 8, "--max-attempts", "2")
    poison = json.loads(ds.read_text().splitlines()[3])
    rule = {"mode": "wrong_count", "fingerprint": fingerprint(poison["input_ids"])}
    httpx.post(fresh.url + "/admin/faults", json={"rules": [rule]}).raise_for_status()
    burst(tmp_path, "rq", fresh, redis_url)
    st = status("rq", redis_url)
    assert st["dead"] == 1 and st["dead_by_reason"] == {"wrong_length": 1}
    text = hsq("status", "--run", "rq", "--redis", redis_url, check=True).stdout
    assert "dead letter by reason: wrong_length: 1" in text
    # Each dead sample by id, with its reason and the error's message.
    failed = hsq("status", "--run", "rq", "--failed", "--redis", redis_url, check=True).stdout
    line = next(ln for ln in failed.splitlines() if poison["id"] in ln)
    assert "wrong_length" in line and "token" in line, failed
    js = status("rq", redis_url, "--failed")["failed"]
    assert [(d["id"], d["reason"], d["attempts"]) for d in js] == [
        (poison["id"], "wrong_length", 2)
    ]
    assert js[0]["message"] and js[0]["worker"]
    assert "failed" not in status("rq", redis_url)  # the stable keys, unless asked

    dry = hsq(
        "requeue",
        "--run",
        "rq",
        "--reason",
        "wrong_length",
        "--dry-run",
        "--redis",
        redis_url,
        check=True,
    )
    assert "would requeue 1" in dry.stdout and status("rq", redis_url)["dead"] == 1
    assert f"  {poison['id']}" in dry.stdout.splitlines()  # the ids it would take
    none = hsq("requeue", "--run", "rq", "--reason", "stale_dump", "--redis", redis_url, check=True)
    assert "selected 0, requeued 0" in none.stdout  # a reason hsq records, none here
    typo = hsq("requeue", "--run", "rq", "--reason", "wrong_lenght", "--redis", redis_url)
    assert typo.returncode == 1 and "no such failure reason 'wrong_lenght'" in typo.stderr
    assert "wrong_length (1)" in typo.stderr and "stale_dump" in typo.stderr
    assert "Traceback" not in typo.stderr and status("rq", redis_url)["dead"] == 1
    odd = hsq(
        "requeue",
        "--run",
        "rq",
        "--sample",
        "no-such-id",
        "--sample",
        json.loads(ds.read_text().splitlines()[0])["id"],
        "--redis",
        redis_url,
    )
    assert "unknown sample id: no-such-id" in odd.stdout and "already done" in odd.stdout
    assert odd.returncode == 1 and "1 unknown sample id" in odd.stderr

    httpx.delete(fresh.url + "/admin/faults").raise_for_status()  # the server is fixed
    assert "requeued 1" in requeue("rq", redis_url, "--failed")
    assert "requeued 0" in requeue("rq", redis_url, "--failed")
    burst(tmp_path, "rq", fresh, redis_url)
    st = status("rq", redis_url)
    assert (st["done"], st["dead"]) == (8, 0)


def test_runs_purge_and_exit_codes(tmp_path: Path, redis_url: str) -> None:
    make_run(tmp_path, "old", redis_url, 3)
    assert "old  done 0/3" in hsq("runs", "--redis", redis_url, check=True).stdout
    # No terminal to confirm on: purge refuses.
    refused = hsq("purge", "--run", "old", "--redis", redis_url)
    assert refused.returncode == 1
    assert (
        "purged run old"
        in hsq("purge", "--run", "old", "--yes", "--redis", redis_url, check=True).stdout
    )
    assert connect(redis_url).keys("hsq:run:old:*") == []
    gone = hsq("status", "--run", "old", "--redis", redis_url)
    assert gone.returncode == 2 and "does not exist" in gone.stderr
    assert hsq("requeue", "--run", "old", "--redis", redis_url).returncode == 2
    down = hsq("status", "--redis", "redis://127.0.0.1:1/0")
    assert down.returncode == 3 and "cannot reach Redis" in down.stderr
    assert "Traceback" not in down.stderr + gone.stderr


@pytest.mark.parametrize(
    "cmd",
    [
        "enqueue",
        "worker",
        "status",
        "requeue",
        "verify",
        "runs",
        "purge",
        "demo",
        "serve-reference",
    ],
)
def test_every_command_has_help_with_an_example(cmd: str) -> None:
    out = hsq(cmd, "--help", check=True).stdout
    assert "Example" in out and "hsq " + cmd in out


def test_redis_url_comes_from_the_environment(tmp_path: Path, redis_url: str) -> None:
    make_run(tmp_path, "env", redis_url, 2)
    env = {"REDIS_URL": redis_url, "PATH": "/usr/bin:/bin"}
    proc = hsq("status", "--run", "env", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total"] == 2
    assert store(redis_url, "env").count(store(redis_url, "env").keys.index) == 2


def workers_of(run: str, redis_url: str) -> list[dict[str, Any]]:
    return status(run, redis_url)["workers"]  # type: ignore[no-any-return]


def first_worker(run: str, redis_url: str, key: str) -> object:
    """The key of the run's first worker record; None before it registered."""
    ws = workers_of(run, redis_url)
    return ws[0].get(key) if ws else None


@pytest.mark.realproc
def test_status_names_a_dead_server_and_a_killed_worker(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    srv = server_factory("--fault", "slow:seconds=0.05", name="downsrv").wait_ready()
    make_run(tmp_path, "down", redis_url, 200)
    w = start_worker(tmp_path, "down", srv, redis_url)
    try:
        st = store(redis_url, "down")
        wait_until(lambda: st.count(st.keys.done) >= 2, 120, interval=0.1)
        srv.signal(signal.SIGKILL)
        srv.proc.wait(10)
        wait_until(lambda: first_worker("down", redis_url, "cause") == "server_down", 60)
        js = status("down", redis_url)
        assert js["eta_s"] is None and js["done"] < 200  # no ETA from a rate before the pause
        assert js["workers"][0]["alive"] and js["workers"][0]["cause_since"] > 0
        text = hsq("status", "--run", "down", "--redis", redis_url, check=True).stdout
        assert "server unreachable since" in text and "ETA - (paused: server unreachable" in text
        # A SIGKILLed worker never unregisters: its record goes stale, then expires.
        w.signal(signal.SIGKILL)
        w.proc.wait(10)
        wait_until(lambda: first_worker("down", redis_url, "alive") is False, 60)
        text = hsq("status", "--run", "down", "--redis", redis_url, check=True).stdout
        assert "[dead (" in text and "[server_down" not in text and "no live workers" in text
    finally:
        w.stop()


def test_status_names_a_full_output_disk(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    out = tmp_path / "small"
    out.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(out)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {mounted.stderr.decode().strip()}")
    w = None
    try:
        ds = tmp_path / "full.jsonl"
        write_synthetic(ds, 40, seed=5, min_len=32, max_len=40)
        enqueue(ds, "full", out, redis_url)
        w = start_worker(tmp_path, "full", fresh, redis_url)
        wait_until(lambda: first_worker("full", redis_url, "cause") == "output_unwritable", 120)
        text = hsq("status", "--run", "full", "--redis", redis_url, check=True).stdout
        assert "output disk full since" in text, text
        js = status("full", redis_url)
        assert js["dead"] == 0 and js["eta_s"] is None  # never the samples' fault
        assert "disk full" in js["workers"][0]["cause_text"]
    finally:
        if w is not None:
            w.stop()
        subprocess.run(["umount", "-l", str(out)], capture_output=True)


def test_worker_figures_from_its_record() -> None:
    from hsq.ops.status import _worker_status, cause_text, eta

    now = 1000.0
    fresh_rec = {"state": "working", "ts": "999", "heartbeat_interval_s": "2", "tokens_per_s": "5"}
    assert _worker_status("a", fresh_rec, now).alive
    stale = _worker_status("a", {**fresh_rec, "ts": "990"}, now)  # 10 s: five beats missed
    assert not stale.alive and stale.state == "dead (no heartbeat for 10s)"
    assert stale.tokens_per_s == 0.0
    gone = _worker_status("a", {}, now)
    assert not gone.alive and gone.state == "dead (heartbeat expired)"
    assert cause_text("output_unwritable", "cannot write /o/x: disk full", None).startswith(
        "output disk full ("
    )
    assert cause_text("server_down", "x does not answer", None) == "server unreachable"
    paused = _worker_status("a", {**fresh_rec, "cause": "server_down", "cause_since": "9"}, now)
    assert eta(100, 5.0, [paused]) is None and eta(0, 0.0, []) == 0.0
    assert eta(100, 5.0, [_worker_status("a", fresh_rec, now)]) == 20.0


def test_status_text_follows_the_worker_and_does_not_point_at_itself() -> None:
    from hsq.ops.status import RunStatus, _worker_status, status_text, worker_line

    now = 1000.0
    rec = {"state": "starting", "ts": "999", "name": "n-0", "done": "0",
           "cause": "server_starting", "cause_message": "x has not answered yet",
           "cause_since": "990"}  # fmt: skip
    starting = _worker_status("a", rec, now)
    assert "[starting: server starting since " in worker_line(starting)
    # A cause the worker cleared is written empty (the record is updated field by field).
    back = _worker_status("a", {**rec, "state": "idle", "cause": "", "cause_since": ""}, now)
    assert back.cause is None and worker_line(back).startswith("  worker n-0 [idle] server")
    # A record that expired says so, not `done 0` for a worker that did samples.
    gone = worker_line(_worker_status("w.1", {}, now))
    assert "done 0" not in gone and "its record expired" in gone
    st = RunStatus(run="bad", total=3, done=1, queued=0, in_progress=0, retry=0, dead=2,
                   missing=0, invalid_lines=0, tokens_done=1, tokens_total=3, bytes_done=1,
                   samples_per_s=0.0, tokens_per_s=0.0, eta_s=0.0,
                   dead_by_reason={"too_long": 2}, workers=[])  # fmt: skip
    assert any("--failed" in x for x in status_text(st))
    assert not any("--failed" in x for x in status_text(st, listed=True))
