"""The worker against a hostile or broken dump dir, with real parts:
a real redis-server, real `hsq worker` processes and real signals, the reference server or
a misbehaving server over real HTTP (tests/hostile.py), real FIFOs, links, immutable files,
a second local user. Unit-level checks of the same rules are in tests/test_worker_unit.py."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from hsq.dump.format import DONE_FILE, META_FILE, TENSOR_FILE
from hsq.dump.ready import READY_FILE, read_ready, write_ready
from hsq.dump.write import write_dump
from hsq.ops import verify
from hsq.producer.synthetic import write_synthetic
from tests.helpers import (
    enqueue,
    hsq_process,
    log_events,
    spawn_worker,
    start_worker,
    store,
    wait_until,
)
from tests.hostile import HostileServer, meta_for, once_per_sample, tensors_for
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
OTHER_USER = "hsq-test-other"


@pytest.fixture(scope="module")
def server(server_factory: Factory) -> ReferenceServer:
    return server_factory(name="hostile_dir").wait_ready()


@pytest.fixture
def fresh(server: ReferenceServer) -> Iterator[ReferenceServer]:
    httpx.delete(server.url + "/admin/faults").raise_for_status()
    yield server
    httpx.delete(server.url + "/admin/faults").raise_for_status()


def slow_server(server: ReferenceServer, seconds: float = 0.05) -> None:
    """Every request takes a while, so the run is still going when the test acts."""
    rules = [{"mode": "slow", "seconds": seconds, "prob": 1.0}]
    httpx.post(server.url + "/admin/faults", json={"rules": rules}).raise_for_status()


def dataset(tmp_path: Path, n: int, seed: int) -> Path:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, n, seed=seed, min_len=4, max_len=32)
    return ds


def started(log: Path) -> Callable[[], bool]:
    return lambda: bool(log_events(log, "worker_started"))


# ------------------------------------------------------------------------------------------- fifos


@pytest.mark.realproc
def test_fifos_in_the_dump_dir_block_nothing_and_sigterm_still_stops_the_worker(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    """A FIFO named req_N/meta.json blocked the dispatcher in open() while it held its
    lock: no sample moved, the heartbeat died and SIGTERM was ignored. Now nothing in the
    dump dir that is not a regular file is opened: FIFOs are removed and counted."""
    n = 24
    enqueue(dataset(tmp_path, n, seed=71), "fifo", tmp_path / "out", redis_url, "--chunk-size", "4")
    slow_server(fresh)
    st = store(redis_url, "fifo")
    d = fresh.dump_dir
    w = start_worker(tmp_path, "fifo", fresh, redis_url, "--inflight", "4", name="fifo-a")
    try:
        wait_until(started(w.log_path), 60)
        plant_fifo_dump(tmp_path, d, "req_990")
        os.mkfifo(d / "req_991")  # a FIFO under a dump's name
        os.mkfifo(d / "req_992.tmp")
        wait_until(lambda: st.count(st.keys.done) >= 8, 60)
        planted = ("req_990", "req_991", "req_992.tmp")
        wait_until(lambda: not any(os.path.lexists(d / p) for p in planted), 30)
        # Once more with requests in flight, then SIGTERM at once: it still stops.
        plant_fifo_dump(tmp_path, d, "req_993")
        w.signal(signal.SIGTERM)
        assert w.proc.wait(60) == 0, w.log_tail()
    finally:
        w.stop()
    why = {str(e["dump"]): e["why"] for e in log_events(w.log_path, "dump_discarded")}
    assert why["req_990"] == "unreadable"
    assert why["req_991"] == why["req_992.tmp"] == "not_a_dump"
    b = start_worker(tmp_path, "fifo", fresh, redis_url, "--burst", name="fifo-b")
    assert b.proc.wait(120) == 0, b.log_tail()
    assert st.count(st.keys.done) == n and st.count(st.keys.dead) == 0


def plant_fifo_dump(tmp_path: Path, dump_dir: Path, name: str) -> None:
    """A dump whose meta.json is a FIFO, built beside the dump dir and renamed in whole:
    the worker removes what it discards, so one built in place could vanish between the
    test's own steps (seen: FileNotFoundError touching req_993/done)."""
    stage = tmp_path / f"stage-{name}"
    stage.mkdir()
    os.mkfifo(stage / META_FILE)
    (stage / DONE_FILE).touch()
    os.rename(stage, dump_dir / name)


def fifo_tensors(srv: HostileServer, _call: int, ids: list[int], rid: str) -> None:
    def swap(tmp: Path) -> None:
        (tmp / TENSOR_FILE).unlink()
        os.mkfifo(tmp / TENSOR_FILE)

    write_dump(
        srv.dump_dir, srv.next_index(), meta_for(ids, rid), tensors_for(ids), before_done=swap
    )


def test_a_fifo_as_the_tensor_file_fails_that_attempt_and_nothing_hangs(
    tmp_path: Path, redis_url: str
) -> None:
    """A FIFO as an in-flight rid's tensor file blocked a persist thread for good: the
    heartbeat stayed fresh while samples stayed in progress forever. Now the attempt fails
    (corrupt_dump, retried) and the run finishes."""
    n = 8
    srv = HostileServer(tmp_path / "dumps", once_per_sample(fifo_tensors))
    try:
        enqueue(dataset(tmp_path, n, seed=72), "fifot", tmp_path / "out", redis_url)
        w = spawn_worker("fifot", srv.url, srv.dump_dir, redis_url, tmp_path / "w.log", "--burst")
        assert w.proc.wait(120) == 0, w.log_tail()
    finally:
        srv.stop()
    st = store(redis_url, "fifot")
    assert st.count(st.keys.done) == n and st.count(st.keys.dead) == 0
    retried = Counter(str(e["reason"]) for e in log_events(w.log_path, "sample_retry"))
    assert retried == {"corrupt_dump": n}
    assert verify(st, tmp_path / "out" / "fifot", deep=True).ok == n


# ---------------------------------------------------------------- links and files under dump names


def chattr(flag: str, path: Path) -> bool:
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def test_links_and_files_under_dump_names_are_removed_once_and_never_followed(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    """A req_* that was a symlink to a directory, or a plain file, was never removed: about
    300 `dump_discarded` warnings a second and a counter without bound. Now a link or a
    file is unlinked (its target untouched) and counted once; an entry that cannot be
    removed at all (here an immutable file inside it) is reported once and skipped."""
    n = 24
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    (precious / META_FILE).write_text("{}")
    enqueue(dataset(tmp_path, n, seed=73), "strays", tmp_path / "out", redis_url)
    slow_server(fresh)
    st = store(redis_url, "strays")
    d = fresh.dump_dir
    stuck = d / "req_998"
    w = start_worker(tmp_path, "strays", fresh, redis_url, "--inflight", "4")
    try:
        wait_until(started(w.log_path), 60)
        os.symlink(precious, d / "req_995")  # a link to a directory
        (d / "req_996").write_text("junk")  # a plain file
        os.symlink(precious, d / "req_997.tmp")
        stuck.mkdir()
        (stuck / "x").write_text("")
        immutable = chattr("+i", stuck / "x")
        wait_until(lambda: st.count(st.keys.done) == n, 90)  # hundreds of polls meanwhile
        planted = ("req_995", "req_996", "req_997.tmp")
        wait_until(lambda: not any(os.path.lexists(d / p) for p in planted), 30)
    finally:
        w.stop()
        chattr("-i", stuck / "x")
        shutil.rmtree(stuck, ignore_errors=True)
    assert sorted(p.name for p in precious.iterdir()) == ["keep.txt", META_FILE]
    events = log_events(w.log_path, "dump_discarded")
    assert Counter(str(e["dump"]) for e in events) == {
        "req_995": 1,
        "req_996": 1,
        "req_997.tmp": 1,
        **({} if immutable else {"req_998": 1}),
    }
    assert {e["why"] for e in events if e["dump"] != "req_998"} == {"not_a_dump"}
    if immutable:
        [unremovable] = log_events(w.log_path, "dump_unremovable")
        assert unremovable["dump"] == "req_998"
    assert st.count(st.keys.dead) == 0


# ------------------------------------------------------------------------ a stale readiness marker


def test_a_stale_readiness_marker_does_not_vouch_for_a_server_that_never_dumps(
    tmp_path: Path, fresh: ReferenceServer, redis_url: str
) -> None:
    """A marker left by an earlier server (its pid dead) vouched for a server that writes
    no dumps into this dir: every sample then died as no_dump. The marker is proven live
    only by a dump; without one the worker exits 2, as without a marker, and every
    sample stays queued. (Here the live server dumps to another directory.)"""
    n = 6
    stale = tmp_path / "dumps"
    stale.mkdir(mode=0o700)
    marker = read_ready(fresh.dump_dir)
    assert marker is not None
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_ready(stale, replace(marker, pid=gone.pid))
    enqueue(dataset(tmp_path, n, seed=74), "stale", tmp_path / "out", redis_url,
            "--max-attempts", "1")  # fmt: skip
    w = spawn_worker("stale", fresh.url, stale, redis_url, tmp_path / "w.log",
                       "--burst", "--inflight", "2", "--dump-timeout", "2")  # fmt: skip
    assert w.proc.wait(90) == 2, w.log_tail()
    assert "not from a live dump hook" in w.log_path.read_text()
    st = store(redis_url, "stale")
    assert st.count(st.keys.done) == 0 and st.count(st.keys.dead) == 0
    assert len(st.outstanding_samples()) == n
    assert not log_events(w.log_path, "sample_retry")


# ---------------------------------------------------------------- a dump dir other users may write


def other_user() -> pwd.struct_passwd:
    """A second local user (created once; tests run as root here and in CI)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second local user")
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        pass
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
        capture_output=True,
        text=True,
    )
    if made.returncode not in (0, 9):  # 9: created meanwhile by a concurrent run
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    return pwd.getpwnam(OTHER_USER)


@pytest.mark.realproc
def test_a_dump_dir_writable_by_other_users_is_refused(
    fresh: ReferenceServer, redis_url: str, tmp_path: Path
) -> None:
    """A dump dir of mode 0777 (not sticky, owned by the worker's user) was accepted: a
    second local user then planted a FIFO as the readiness marker and the worker hung in
    open() at start. Now such a dir is refused (exit 2, told what mode to use, nothing
    touched), and even when forced the FIFO is refused instead of opened."""
    user = other_user()
    base = Path(tempfile.mkdtemp(prefix="hsq-c1-"))
    try:
        os.chmod(base, 0o711)  # the other user may pass through, not list
        d = base / "dumps"
        d.mkdir()
        os.chmod(d, 0o777)

        def as_other(*argv: str) -> None:
            subprocess.run(argv, check=True, user=user.pw_uid, group=user.pw_gid, extra_groups=[])

        as_other("mkfifo", str(d / READY_FILE))
        as_other("mkdir", str(d / "req_5"))
        as_other("mkfifo", str(d / "req_5" / META_FILE))
        enqueue(dataset(tmp_path, 2, seed=75), "open", tmp_path / "out", redis_url)
        args = ["worker", "--run", "open", "--server", fresh.url, "--redis", redis_url]
        refused = hsq_process(*args, "--dump-dir", str(d), "--burst", timeout=60)
        assert refused.returncode == 2, refused.stderr
        assert "writable by other users (mode 0777)" in refused.stderr
        assert f"chmod 700 {d}" in refused.stderr and "Traceback" not in refused.stderr
        assert stat.S_IMODE(d.stat().st_mode) == 0o777
        assert stat.S_ISFIFO(os.lstat(d / "req_5" / META_FILE).st_mode)  # nothing touched
        forced = hsq_process(*args, "--dump-dir", str(d), "--burst", "--dump-dir-force", timeout=60)
        assert forced.returncode == 2 and "not a regular file (a FIFO)" in forced.stderr
        st = store(redis_url, "open")
        assert st.count(st.keys.done) == 0 and len(st.outstanding_samples()) == 2
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------- a dump dir swapped mid-run


@pytest.mark.realproc
def test_a_dump_dir_removed_recreated_or_swapped_mid_run_sends_nothing_to_the_dead_letter(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    """The dump dir removed and re-created, or swapped for a link, under a running worker:
    the staging dir vanished and every later sample was dead-lettered as corrupt_dump
    ("cannot stage ..."). That is the environment's fault: the worker hands its work back,
    takes the directory again (re-creating it if missing) and goes on."""
    n = 40
    srv = server_factory("--fault", "slow:seconds=0.05", name="moving").wait_ready()
    d = srv.dump_dir
    enqueue(dataset(tmp_path, n, seed=76), "moving", tmp_path / "out", redis_url,
            "--chunk-size", "4", "--max-attempts", "1")  # fmt: skip
    st = store(redis_url, "moving")
    w = start_worker(tmp_path, "moving", srv, redis_url, "--inflight", "4")

    def retaken(k: int) -> Callable[[], bool]:
        return lambda: len(log_events(w.log_path, "dump_dir_taken_again")) >= k

    def swapped(make: Callable[[], None], away: str) -> None:
        w.signal(signal.SIGSTOP)  # a worker frozen mid-run, the directory changed meanwhile
        try:
            os.rename(d, tmp_path / away)
            make()
        finally:
            w.signal(signal.SIGCONT)

    try:
        wait_until(lambda: st.count(st.keys.done) >= 6, 60)
        os.rename(d, tmp_path / "away1")  # removed: the worker makes it again
        wait_until(retaken(1), 60)
        wait_until(lambda: st.count(st.keys.done) >= 16, 60)
        swapped(lambda: d.mkdir(mode=0o700), "away2")  # removed and re-created
        wait_until(retaken(2), 60)
        wait_until(lambda: st.count(st.keys.done) >= 26, 60)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        swapped(lambda: d.symlink_to(elsewhere), "away3")  # swapped for a link
        wait_until(retaken(3), 60)
        wait_until(lambda: st.count(st.keys.done) == n, 90)
    finally:
        w.stop()
        srv.stop()
    assert st.count(st.keys.dead) == 0
    changed = log_events(w.log_path, "dump_dir_changed")
    assert len(changed) == 3, changed
    handed = {str(e["reason"]) for e in log_events(w.log_path, "sample_handed_back")}
    assert handed <= {"dump_dir_changed"}
    assert verify(st, tmp_path / "out" / "moving", deep=True).ok == n


# --------------------------------------------------------------------------- two dumps for one rid


def two_full_dumps(srv: HostileServer, _call: int, ids: list[int], rid: str) -> None:
    meta, tensors = meta_for(ids, rid), tensors_for(ids)
    write_dump(srv.dump_dir, srv.next_index(), meta, tensors)
    time.sleep(0.05)  # the worker has usually taken the first before the second lands
    write_dump(srv.dump_dir, srv.next_index(), meta, tensors)


def test_two_full_dumps_for_one_rid_fail_the_attempt_with_multiple_dumps(
    tmp_path: Path, redis_url: str
) -> None:
    """Two full dumps carrying one rid: the first was accepted and the second discarded as
    late in 11 of 12 cases, while docs/dump-protocol.md said the sample fails with
    multiple_dumps. Now the attempt fails (retried) whether the second dump is seen with
    the first or after the first was taken, as long as it lands before the dump is used."""
    n = 8
    srv = HostileServer(tmp_path / "dumps", once_per_sample(two_full_dumps))
    try:
        enqueue(dataset(tmp_path, n, seed=77), "twice", tmp_path / "out", redis_url)
        w = spawn_worker("twice", srv.url, srv.dump_dir, redis_url, tmp_path / "w.log", "--burst")
        assert w.proc.wait(120) == 0, w.log_tail()
    finally:
        srv.stop()
    st = store(redis_url, "twice")
    assert st.count(st.keys.done) == n and st.count(st.keys.dead) == 0
    retried = Counter(str(e["reason"]) for e in log_events(w.log_path, "sample_retry"))
    assert retried == {"multiple_dumps": n}
    assert verify(st, tmp_path / "out" / "twice", deep=True).ok == n
