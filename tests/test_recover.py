"""`hsq recover` after a real Redis wipe mid-run, with real processes:
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

from hsq.outputs.format import output_relpath
from hsq.producer.synthetic import write_synthetic
from hsq.store import connect
from tests.helpers import enqueue, hsq, start_worker, store, wait_until
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
N = 30


@pytest.fixture(scope="module")
def server(server_factory: Factory) -> ReferenceServer:
    return server_factory(name="recsrv").wait_ready()


@pytest.fixture(scope="module")
def other_layers(server_factory: Factory) -> ReferenceServer:
    """A server capturing layers 1,2, the other model of the identity tests (each start
    costs seconds of torch imports); nothing sets its faults or stops it."""
    return server_factory("--layers", "1,2", name="recother").wait_ready()


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
    for its run to come back would also pass.)"""
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


def _split_dataset(full: Path, first: Path, rest: Path) -> None:
    lines = full.read_text().splitlines(keepends=True)
    first.write_text(lines[0])
    rest.write_text("".join(lines[1:]))


def test_recover_decides_the_runs_identity_by_majority_or_announcement_never_by_one_file(
    tmp_path: Path, server: ReferenceServer, other_layers: ReferenceServer, redis_url: str
) -> None:
    """One stale file of an earlier model under the same run name came
    first in dataset order; recover pinned its model, marked it done, rejected the 11 good
    files, and the real server's worker then refused to start. Now the identity is what the
    run's servers announce (--server-dump-dir) or what most files hold; the others are stale:
    reported and enqueued, never marked done."""
    other = other_layers
    full, first, rest = tmp_path / "full.jsonl", tmp_path / "first.jsonl", tmp_path / "rest.jsonl"
    write_synthetic(full, 12, seed=9, min_len=4, max_len=16)
    _split_dataset(full, first, rest)
    out = tmp_path / "out"
    enqueue(first, "idn", out, redis_url)  # s000000, from a server with other layers
    finish_burst(tmp_path, "idn", other, redis_url, "stale")
    connect(redis_url).flushall()
    enqueue(rest, "idn", out, redis_url)  # the 11 others, from the run's real server
    finish_burst(tmp_path, "idn", server, redis_url, "good")
    connect(redis_url).flushall()
    assert len(list((out / "idn").rglob("*.safetensors"))) == 12

    def recover(*extra: str) -> str:
        return hsq("recover", str(full), "--run", "idn", "--out", str(out), "--redis", redis_url,
                   "--no-progress", *extra, check=True).stdout  # fmt: skip

    st = store(redis_url, "idn")
    said = recover("--server-dump-dir", str(other.dump_dir))  # that server announces 1,2
    assert "recovered       1 " in said and "stale files     11" in said, said
    assert st.require_config().layer_ids == [1, 2] and st.done_among(["s000000"])
    connect(redis_url).flushall()

    said = recover()
    assert "recovered       11 " in said and "stale files     1 " in said, said
    assert "majority: 11 of 12" in said, said
    assert not st.done_among(["s000000"])  # stale: enqueued again, not done
    finish_burst(tmp_path, "idn", server, redis_url, "after")  # the run's server accepts it
    assert st.count(st.keys.done) == 12
    deep = hsq("verify", "--run", "idn", "--redis", redis_url, "--deep", "--no-progress")
    assert deep.returncode == 0 and "ok 12" in deep.stdout, deep.stdout


def test_recover_refuses_a_tie_and_takes_an_explicit_identity(
    tmp_path: Path, server: ReferenceServer, other_layers: ReferenceServer, redis_url: str
) -> None:
    other = other_layers
    full, first, rest = tmp_path / "full.jsonl", tmp_path / "first.jsonl", tmp_path / "rest.jsonl"
    write_synthetic(full, 2, seed=8, min_len=4, max_len=16)
    _split_dataset(full, first, rest)
    out = tmp_path / "out"
    for part, srv in ((first, other), (rest, server)):
        enqueue(part, "tie", out, redis_url)
        finish_burst(tmp_path, "tie", srv, redis_url, srv.dump_dir.parent.name)
        connect(redis_url).flushall()
    base = ["recover", str(full), "--run", "tie", "--out", str(out), "--redis", redis_url,
            "--no-progress"]  # fmt: skip
    tie = hsq(*base)
    assert tie.returncode == 2 and "no majority" in tie.stderr, tie.stderr
    assert hsq("status", "--run", "tie", "--redis", redis_url).returncode == 2  # nothing made
    said = hsq(*base, "--layers", "1,2", check=True).stdout
    assert "recovered       1 " in said and "stale files     1 " in said, said


def test_recover_never_adopts_a_symlink_or_a_symlinked_shard(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    """A symlink to a valid copy outside OUT was marked done; verify then
    refused it forever. Now it is rejected (lstat, never followed) and its sample enqueued;
    the worker replaces the link with a file, and the copy outside is never touched."""
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 6, seed=12, min_len=4, max_len=16)
    out = tmp_path / "out"
    enqueue(ds, "lnk", out, redis_url)
    finish_burst(tmp_path, "lnk", server, redis_url, "lnk")
    connect(redis_url).flushall()
    root = out / "lnk"
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = root / output_relpath("s000001")
    copy = outside / linked.name
    linked.rename(copy)
    linked.symlink_to(copy)
    shard = (root / output_relpath("s000004")).parent
    assert shard != linked.parent
    moved = outside / "shard"
    shard.rename(moved)
    shard.symlink_to(moved)
    in_shard = [p.stem for p in moved.iterdir()]
    rec = hsq("recover", str(ds), "--run", "lnk", "--out", str(out), "--redis", redis_url,
              "--no-progress", check=True)  # fmt: skip
    assert f"recovered       {6 - 1 - len(in_shard)} " in rec.stdout, rec.stdout
    assert "s000001: a symlink" in rec.stderr and "shard directory" in rec.stderr, rec.stderr
    st = store(redis_url, "lnk")
    assert not st.done_among(["s000001", *in_shard])
    before = copy.read_bytes()
    shard.unlink()  # the operator removes the symlinked shard; the worker redoes its files
    finish_burst(tmp_path, "lnk", server, redis_url, "lnk2")
    assert st.count(st.keys.done) == 6 and not linked.is_symlink()
    assert copy.read_bytes() == before
    deep = hsq("verify", "--run", "lnk", "--redis", redis_url, "--deep", "--no-progress")
    assert deep.returncode == 0 and "ok 6" in deep.stdout, deep.stdout


def _two_extractions(
    tmp_path: Path,
    run: str,
    redis_url: str,
    first: tuple[ReferenceServer, tuple[str, ...]],
    rest: tuple[ReferenceServer, tuple[str, ...]],
) -> Path:
    """OUT/RUN holding 4 files of one extraction and 8 of another (Redis wiped after each),
    as when a run name is reused with other settings; returns the whole dataset."""
    full = tmp_path / "full.jsonl"
    write_synthetic(full, 12, seed=31, min_len=4, max_len=16)
    lines = full.read_text().splitlines(keepends=True)
    parts = [(tmp_path / "a.jsonl", lines[:4], first), (tmp_path / "b.jsonl", lines[4:], rest)]
    for path, part, (srv, flags) in parts:
        path.write_text("".join(part))
        enqueue(path, run, tmp_path / "out", redis_url, *flags)
        finish_burst(tmp_path, run, srv, redis_url, srv.dump_dir.parent.name)
        connect(redis_url).flushall()
    assert len(list((tmp_path / "out" / run).rglob("*.safetensors"))) == 12
    return full


def _recover_finish_verify(
    tmp_path: Path, run: str, full: Path, srv: ReferenceServer, redis_url: str, why: str
) -> None:
    res = hsq("recover", str(full), "--run", run, "--out", str(tmp_path / "out"),
              "--redis", redis_url, "--no-progress", check=True)  # fmt: skip
    said = res.stdout
    assert "recovered       8 " in said and "rejected files  4 " in said, said
    told = [ln for ln in res.stderr.splitlines() if ln.startswith("  rejected file of ")]
    assert len(told) == 4 and all(why in ln for ln in told), res.stderr
    st = store(redis_url, run)
    assert st.count(st.keys.done) == 8
    finish_burst(tmp_path, run, srv, redis_url, "after")  # the 4 are redone as the run's
    assert st.count(st.keys.done) == 12
    deep = hsq("verify", "--run", run, "--redis", redis_url, "--deep", "--no-progress")
    assert deep.returncode == 0 and "ok 12" in deep.stdout, deep.stdout + deep.stderr


@pytest.mark.timeout(300)  # two servers, three burst workers, a deep verify
def test_recover_rejects_files_without_the_runs_prenorm_state(
    tmp_path: Path, server: ReferenceServer, server_factory: Factory, redis_url: str
) -> None:
    """4 files without the pre-norm state (an earlier extraction under the run
    name) and 8 with it; the run is --prenorm. Old code: recover re-marked all 12 done and
    `verify` then called 4 corrupt. Now the 4 are rejected with the reason and redone."""
    pre = server_factory("--prenorm", name="recpre").wait_ready()
    full = _two_extractions(tmp_path, "pre", redis_url, (server, ()), (pre, ("--prenorm",)))
    why = "no pre-norm state (last_hidden_state_prenorm), which the run stores"
    _recover_finish_verify(tmp_path, "pre", full, pre, redis_url, why)
    assert store(redis_url, "pre").require_config().prenorm


@pytest.mark.timeout(300)  # two servers, three burst workers, a deep verify
def test_recover_rejects_files_of_another_states_dtype(
    tmp_path: Path, server: ReferenceServer, server_factory: Factory, redis_url: str
) -> None:
    """4 float32-state files and 8 bf16, same model and layers. Old code:
    recover marked all 12 done ("majority: 12 of 12"), a mixed-dtype run the worker's dtype
    pin forbids. Now the dtype is part of the identity: the 4 are rejected and redone, and
    the run's dtype is pinned as the worker pins it."""
    f32 = server_factory("--dump-dtype", "float32", name="recf32").wait_ready()
    full = _two_extractions(tmp_path, "dt", redis_url, (f32, ()), (server, ()))
    why = "states stored as float32, the run's are bfloat16"
    _recover_finish_verify(tmp_path, "dt", full, server, redis_url, why)
    cfg = store(redis_url, "dt").require_config()
    assert cfg.dump_dtype == "bfloat16" and cfg.hidden_size is not None
    for f in (tmp_path / "out" / "dt").rglob("*.safetensors"):
        assert load_file(str(f))["last_hidden_state"].dtype == torch.bfloat16
