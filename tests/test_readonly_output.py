"""The output filesystem going read-only, on a real tmpfs remounted `ro`
(needs root and mount; skipped otherwise) and with a real `hsq worker`.

Before the fix the run survived, but every handed-back sample was reported `io_error` and
the pause as `dataset_unavailable` ("[Errno 30] Read-only file system"): in write_durably
the cleanup `tmp.unlink` raised EROFS itself and masked the OutputError, and a new shard's
`mkdir` sat outside the try. Now both are an OutputError with reason `output_read_only`,
and the worker pauses as `output_read_only`.

With persist processes the reason crossed the process boundary only for dataset errors
(issue 42 D7: `output_unwritable` with 2 persist processes, `output_read_only` with 0):
the same worker test runs with both, and a real persist process writes to a read-only and
to a full tmpfs."""

from __future__ import annotations

import errno
import pickle
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsq import errors
from hsq.fsio import write_durably
from hsq.producer.synthetic import write_synthetic
from hsq.workers.policy import Kind, Pause, classify
from tests.helpers import enqueue, log_events, spawn_worker, store, wait_until
from tests.hostile import HostileServer


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "mnt"
    point.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=64m", "hsq-ro-test", str(point))
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def remount(point: Path, mode: str) -> None:
    _mount("-o", f"remount,{mode}", str(point))


def test_write_durably_names_a_read_only_filesystem(mnt: Path) -> None:
    (mnt / "old").mkdir()
    remount(mnt, "ro")
    for target in (mnt / "old" / "s.safetensors", mnt / "new" / "s.safetensors"):
        with pytest.raises(errors.OutputError) as info:
            write_durably(target, lambda _fd: None)
        assert info.value.reason == errors.OUTPUT_READ_ONLY, target
        assert "read-only file system" in str(info.value)
    remount(mnt, "rw")
    write_durably(mnt / "new" / "s.safetensors", lambda _fd: None)  # and it writes again


def test_a_read_only_output_is_its_own_pause_and_survives_a_process_pool() -> None:
    exc = errors.OutputError("cannot write x: read-only file system", reason="output_read_only")
    f = classify(exc)
    assert (f.kind, f.reason, f.pause) == (Kind.PAUSE, "output_read_only", Pause.OUTPUT_READ_ONLY)
    back = pickle.loads(pickle.dumps(exc))  # as a persist pool hands an error back
    assert back.reason == "output_read_only" and str(back) == str(exc)
    ds = pickle.loads(pickle.dumps(errors.DatasetError("gone", "dataset_unreadable")))
    assert ds.reason == "dataset_unreadable"


def persist_in_a_process(tmp_path: Path, out: Path) -> BaseException:
    """What a real persist process reports, through its frames, for writing ``out``."""
    from hsq.dataset.jsonl import Sample
    from hsq.dump.write import write_dump
    from hsq.workers.persist.procs import PersistProcs
    from hsq.workers.persist.work import WriteJob
    from tests.hostile import meta_for, tensors_for

    ids = [3, 1, 4, 1, 5]
    (tmp_path / "d").mkdir(parents=True)
    meta = meta_for(ids, "r1")
    staged = write_dump(tmp_path / "d", 0, meta, tensors_for(ids), fsync=False)
    job = WriteJob.of(out, Sample("s1", ids, None), meta, staged, "run", "bf16", False)
    procs = PersistProcs(1, direct_io=False)
    try:
        with pytest.raises(Exception) as info:
            procs.write(job, lambda: None, {})
    finally:
        procs.close()
    return info.value


def test_a_persist_process_reports_a_read_only_and_a_full_output_each_as_such(
    tmp_path: Path, mnt: Path
) -> None:
    (mnt / "out").mkdir()
    remount(mnt, "ro")
    exc = persist_in_a_process(tmp_path / "ro", mnt / "out" / "s1.safetensors")
    assert isinstance(exc, errors.OutputError), exc
    assert exc.reason == errors.OUTPUT_READ_ONLY and "read-only file system" in str(exc)
    assert classify(exc).pause is Pause.OUTPUT_READ_ONLY
    remount(mnt, "rw")
    with (mnt / "filler").open("wb") as f:  # the disk full
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError as full:
            assert full.errno == errno.ENOSPC
    exc = persist_in_a_process(tmp_path / "full", mnt / "out" / "s1.safetensors")
    assert isinstance(exc, errors.OutputError), exc
    assert exc.reason == "output_unwritable" and "disk full" in str(exc)
    assert isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOSPC


@pytest.mark.timeout(600)
@pytest.mark.parametrize("procs", ["0", "2"])
def test_a_worker_pauses_on_a_read_only_output_as_such_and_finishes_once_writable(
    tmp_path: Path, mnt: Path, redis_url: str, procs: str
) -> None:
    run = "rofs"
    out = mnt / "out"
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 4, seed=71, min_len=4, max_len=12)
    enqueue(ds, run, out, redis_url)
    (out / run).mkdir(parents=True, exist_ok=True)
    remount(mnt, "ro")
    srv = HostileServer(tmp_path / "dumps")
    w = spawn_worker(
        run, srv.url, srv.dump_dir, redis_url, tmp_path / "w.log", "--persist-procs", procs
    )
    try:
        wait_until(lambda: bool(log_events(w.log_path, "sample_handed_back")), timeout=180)
        remount(mnt, "rw")
        st = store(redis_url, run)
        wait_until(lambda: st.count(st.keys.done) == 4, timeout=300)
    finally:
        w.stop()
        srv.stop()
    assert st.count(st.keys.dead) == 0
    back = log_events(w.log_path, "sample_handed_back")
    assert back and {e["reason"] for e in back} == {"output_read_only"}, back
    causes = {e["cause"] for e in log_events(w.log_path, "pausing")}
    assert causes == {"output_read_only"}, causes
