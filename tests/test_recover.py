"""`hsq recover` after a real Redis wipe mid-run (issue 15 item 2), with real processes:
a reference server, workers, redis-server, FLUSHALL."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from hsq.harness.procs import ReferenceServer
from hsq.harness.synthetic import write_synthetic
from hsq.outputs import output_relpath
from hsq.store import connect
from tests.helpers import enqueue, hsq, start_worker, store, wait_until

Factory = Callable[..., ReferenceServer]
N = 30


@pytest.fixture(scope="module")
def server(server_factory: Factory) -> ReferenceServer:
    return server_factory(name="recsrv").wait_ready()


def finish_burst(tmp: Path, run: str, server: ReferenceServer, redis_url: str, name: str) -> None:
    w = start_worker(tmp, run, server, redis_url, "--burst", name=name)
    assert w.proc.wait(300) == 0, w.log_tail()


def test_flushall_mid_run_then_recover_finishes_every_sample_exactly_once(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    """FLUSHALL while a worker runs, `hsq recover`, then finish: every sample done exactly
    once, files bit-identical to an undisturbed run. The old code had no way back: status,
    verify and requeue said the run did not exist, and the files on disk were not reused.

    Assumes only what today's worker does: after the wipe its writes are refused (fenced),
    so the test stops it and starts fresh workers after the recover. (A worker that waits
    for its run to come back, issue 15's worker side, would also pass.)"""
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, N, seed=11, min_len=4, max_len=48)
    out = tmp_path / "out"
    enqueue(ds, "rec", out, redis_url, "--chunk-size", "2")
    rules = [{"mode": "slow", "seconds": 0.1, "prob": 1.0}]
    httpx.post(server.url + "/admin/faults", json={"rules": rules}).raise_for_status()
    st = store(redis_url, "rec")
    w = start_worker(tmp_path, "rec", server, redis_url, name="before")
    try:
        wait_until(lambda: st.count(st.keys.done) >= 8, timeout=120)
        connect(redis_url).flushall()
        time.sleep(0.5)  # let the worker try (and fail) to write into the wiped run
    finally:
        w.stop()
    httpx.delete(server.url + "/admin/faults").raise_for_status()
    on_disk = {p.name for p in (out / "rec").rglob("*.safetensors")}
    assert len(on_disk) >= 8
    assert hsq("status", "--run", "rec", "--redis", redis_url).returncode == 2

    rec = hsq("recover", str(ds), "--run", "rec", "--out", str(out), "--redis", redis_url,
              "--chunk-size", "2", "--no-progress", check=True)  # fmt: skip
    recovered = int(rec.stdout.split("recovered")[1].split()[0])
    assert recovered == len(on_disk), rec.stdout
    assert st.count(st.keys.done) == len(on_disk)

    finish_burst(tmp_path, "rec", server, redis_url, "after")
    status = json.loads(
        hsq("status", "--run", "rec", "--redis", redis_url, "--json", check=True).stdout
    )
    assert (status["done"], status["dead"], status["missing"]) == (N, 0, 0), status
    deep = hsq("verify", "--run", "rec", "--redis", redis_url, "--deep", "--no-progress")
    assert deep.returncode == 0 and f"ok {N}" in deep.stdout, deep.stdout
    files = sorted((out / "rec").rglob("*.safetensors"))
    assert len(files) == N and not list((out / "rec").rglob("*.tmp"))

    # The same dataset, undisturbed: every tensor must be bit-identical.
    enqueue(ds, "ref", out, redis_url, "--chunk-size", "2")
    finish_burst(tmp_path, "ref", server, redis_url, "ref")
    for sid in [f"s{i:06d}" for i in range(N)]:
        got = load_file(str(out / "rec" / output_relpath(sid)))
        want = load_file(str(out / "ref" / output_relpath(sid)))
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype
            assert (
                got[name]
                .view(-1)
                .view(dtype=_raw(got[name]))
                .equal(want[name].view(-1).view(dtype=_raw(want[name])))
            ), (sid, name)


def _raw(t: object) -> torch.dtype:
    import torch

    assert isinstance(t, torch.Tensor)
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def test_recover_rejects_a_file_that_does_not_match_its_dataset_line(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    """recover re-marks only files whose header, tensors and token ids match the dataset
    line; a file from another dataset under the same id is enqueued again, not trusted."""
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 4, seed=5, min_len=4, max_len=16)
    out = tmp_path / "out"
    enqueue(ds, "rj", out, redis_url)
    finish_burst(tmp_path, "rj", server, redis_url, "rj")
    connect(redis_url).flushall()
    other = tmp_path / "other.jsonl"
    write_synthetic(other, 4, seed=6, min_len=4, max_len=16)  # same ids, other tokens
    rec = hsq("recover", str(other), "--run", "rj", "--out", str(out), "--redis", redis_url,
              "--no-progress", check=True)  # fmt: skip
    assert "recovered       0" in rec.stdout and "rejected files  4" in rec.stdout, rec.stdout
    assert store(redis_url, "rj").queue_lengths()["main"] == 1  # all 4 in one chunk
