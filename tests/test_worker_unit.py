"""The worker's pure parts in-process, in milliseconds: the failure policy, rid matching
(protocol v2), the chunk book, the HTTP client's limits and the dump dir checks."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from hsq import errors
from hsq.dataset.jsonl import IndexEntry
from hsq.dump.find import remove_dump
from hsq.dump.format import DONE_FILE, META_FILE, TENSOR_FILE
from hsq.dump.read import open_dump_tensors, read_meta
from hsq.dump.ready import READY_FILE, read_ready
from hsq.fsio import open_regular
from hsq.store import ChunkJob
from hsq.workers.chunks import ChunkBook
from hsq.workers.lock import LOCK_NAME, DumpDirLock
from hsq.workers.policy import Kind, Outcome, Pause, backoff, classify, decide
from hsq.workers.send import ridmatch
from hsq.workers.send.client import MAX_ANSWER_BYTES, MidRequestFailure, ServerClient
from hsq.workers.send.dispatch import Dispatcher
from hsq.workers.send.ridmatch import RidMatcher
from hsq.workers.settings import WorkerSettings
from hsq.workers.startup import STAGING, check_dump_dir, take_dump_dir
from tests.support.fakedump import IDS, make

# ---------------------------------------------------------------------------- policy


@pytest.mark.parametrize(
    ("exc", "kind", "reason"),
    [
        (errors.StaleDumpError("x"), Kind.SAMPLE, "stale_dump"),
        (errors.NonFiniteDumpError("x"), Kind.SAMPLE, "non_finite"),
        (errors.DatasetError("x", "bad_line"), Kind.PERMANENT, "bad_line"),
        (errors.DatasetError("x", "dataset_changed"), Kind.PERMANENT, "dataset_changed"),
        (errors.DatasetError("x", "dataset_unreadable"), Kind.PAUSE, "dataset_unreadable"),
        (OSError(errno.EIO, "Input/output error"), Kind.PAUSE, "io_error"),
        (FileNotFoundError("gone"), Kind.PAUSE, "io_error"),
        (errors.ServerRejectedError("x", 400), Kind.PERMANENT, "rejected"),
        (errors.ServerRejectedError("x", 500), Kind.SERVER_FAIL, "server_error"),
        (MidRequestFailure("x"), Kind.SERVER_FAIL, "server_crash"),
        (errors.ServerUnavailableError("x"), Kind.PAUSE, "server_unavailable"),
        (errors.OutputError("x"), Kind.PAUSE, "output_unwritable"),
        (errors.OutputError("x", reason=errors.OUTPUT_READ_ONLY), Kind.PAUSE, "output_read_only"),
        (errors.StoreUnavailableError("x"), Kind.PAUSE, "store_unavailable"),
        (errors.RunChangedError("x"), Kind.RUN_CHANGED, "run_changed"),
        (AttributeError("'int' object has no attribute 'get'"), Kind.SAMPLE, "internal_error"),
        (errors.DumpDirError("x"), Kind.PAUSE, "dump_dir_changed"),
        (errors.HookInactiveError("x"), Kind.PAUSE, "hook_inactive"),
    ],
)
def test_every_exception_has_a_kind_and_a_reason(exc: Exception, kind: Kind, reason: str) -> None:
    f = classify(exc)
    assert (f.kind, f.reason) == (kind, reason)
    assert f.message


def test_sample_faults_retry_then_die_after_max_attempts() -> None:
    f = classify(errors.WrongLengthError("x"))
    assert decide(f, 0, 3) == decide(f, 0, 3)
    assert decide(f, 0, 3).outcome is Outcome.RETRY and decide(f, 0, 3).attempts == 1
    assert decide(f, 1, 3).outcome is Outcome.RETRY
    last = decide(f, 2, 3)
    assert last.outcome is Outcome.DEAD and last.attempts == 3


@pytest.mark.parametrize(
    "exc",
    [
        errors.DatasetError("x", "dataset_unreadable"),
        OSError(errno.EIO, "eio"),
        errors.ServerUnavailableError("x"),
        errors.OutputError("x"),
        errors.StoreUnavailableError("x"),
    ],
)
def test_transient_faults_never_reach_the_dead_letter_whatever_the_attempt(
    exc: Exception,
) -> None:
    d = decide(classify(exc), attempt=99, max_attempts=1)
    assert d.outcome is Outcome.HAND_BACK and d.pause is not None


def test_server_failures_use_the_crash_budget_not_attempts() -> None:
    five = classify(errors.ServerRejectedError("x", 502))
    d = decide(five, attempt=0, max_attempts=1, crashes=1, max_crashes=3)
    assert d.outcome is Outcome.RETRY and d.attempts == 0 and d.pause is Pause.SERVER_ERRORS
    assert decide(five, 0, 1, crashes=3, max_crashes=3).outcome is Outcome.DEAD
    mid = classify(MidRequestFailure("x"))
    assert decide(mid, 0, 1, crashes=2).outcome is Outcome.HAND_BACK
    assert decide(mid, 0, 1, crashes=3).reason == "server_crash"


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff(n, base=1, cap=5) for n in (1, 2, 3, 4)] == [1, 2, 4, 5]


# ---------------------------------------------------------------------------- rid matching


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    d = tmp_path / "staging"
    d.mkdir()
    return d


def matcher(dump_dir: Path, staging: Path, timeout: float = 5.0) -> RidMatcher:
    return RidMatcher(dump_dir, staging, timeout_s=timeout, split_grace_s=0.2)


def test_dumps_are_attributed_by_rid_in_any_order(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    for rid in ("a", "b", "c"):
        m.add(rid, len(IDS))
    make(dump_dir, 5, IDS, "c")
    make(dump_dir, 6, IDS, "a")
    decided, dropped = m.poll(now=0.0)
    assert {d.rid: d.dump.path.name for d in decided if d.dump} == {"a": "a", "c": "c"}
    assert not dropped and set(m.wanted) == {"b"}
    assert sorted(p.name for p in staging.iterdir()) == ["a", "c"]
    assert not list(dump_dir.iterdir())  # moved out: no later scan sees them


def test_unknown_rid_is_removed_and_counted_never_attributed(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("mine", len(IDS))
    make(dump_dir, 1, IDS, "WARMUP_0")
    decided, dropped = m.poll(now=0.0)
    assert decided == [] and [(w, r) for w, _, r in dropped] == [("unknown_rid", "WARMUP_0")]
    assert m.discarded == {"unknown_rid": 1} and not list(dump_dir.iterdir())


def test_two_dumps_for_one_rid_fail_it_with_multiple_dumps(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    make(dump_dir, 1, IDS, "r")
    make(dump_dir, 2, IDS, "r")
    [d], _ = m.poll(now=0.0)
    assert isinstance(d.error, errors.MultipleDumpsError) and d.error.reason == "multiple_dumps"
    assert not list(dump_dir.iterdir())


def test_a_split_prefill_is_caught_even_when_its_parts_land_apart(
    dump_dir: Path, staging: Path
) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    make(dump_dir, 1, IDS[:6], "r", input_fingerprint="x")  # first chunk of the prefill
    m.answered("r", now=0.0)
    assert m.poll(now=0.05) == ([], [])  # short: held for the rest
    make(dump_dir, 2, IDS[6:], "r", input_fingerprint="x")
    [d], _ = m.poll(now=0.1)
    assert isinstance(d.error, errors.MultipleDumpsError)


def test_a_short_dump_alone_is_delivered_after_the_grace(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    make(dump_dir, 1, IDS[:6], "r")
    m.answered("r", now=0.0)
    assert m.poll(now=0.1)[0] == []
    [d], _ = m.poll(now=0.5)
    assert d.dump is not None and d.dump.meta.num_tokens == 6  # check_meta: wrong_length


def test_late_dump_after_a_timeout_is_discarded_and_fails_nothing_else(
    dump_dir: Path, staging: Path
) -> None:
    """One late dump sent 6 of the next 8 samples to the dead letter."""
    m = matcher(dump_dir, staging, timeout=1.0)
    m.add("old", len(IDS))
    m.answered("old", now=0.0)
    [d], _ = m.poll(now=2.0)
    assert isinstance(d.error, errors.NoDumpError)
    for i in range(8):
        m.add(f"next{i}", len(IDS))
    make(dump_dir, 1, IDS, "old")  # the late one lands among the next requests
    for i in range(8):
        make(dump_dir, 2 + i, IDS, f"next{i}")
    decided, dropped = m.poll(now=2.1)
    assert [(w, r) for w, _, r in dropped] == [("late", "old")]
    assert len(decided) == 8 and all(x.dump is not None for x in decided)


def test_abandoned_rid_dump_is_late(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    m.abandon("r")
    make(dump_dir, 1, IDS, "r")
    assert [w for w, _, _ in m.poll(now=0.0)[1]] == ["late"]
    with pytest.raises(ValueError):
        m.add("r", len(IDS))  # a rid is never reused


def test_renamed_dump_without_done_fails_its_rid_at_once(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    make(dump_dir, 1, IDS, "r", mark_done=False)
    [d], _ = m.poll(now=0.0)
    assert isinstance(d.error, errors.IncompleteDumpError)


def test_timeout_says_stale_when_foreign_dumps_came_instead(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging, timeout=1.0)
    m.add("r", len(IDS))
    m.answered("r", now=0.0)
    make(dump_dir, 1, IDS, "someone-else")
    assert m.poll(now=0.5)[0] == []
    [d], _ = m.poll(now=1.5)
    assert isinstance(d.error, errors.StaleDumpError)


def test_timeout_is_counted_from_the_answer_not_the_send(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging, timeout=1.0)
    m.add("r", len(IDS))
    assert m.poll(now=100.0)[0] == []  # the HTTP request has its own timeout
    m.answered("r", now=100.0)
    assert isinstance(m.poll(now=101.5)[0][0].error, errors.NoDumpError)


@pytest.mark.parametrize(
    "meta", [b"\xff\xfe not utf-8", b'{"rid": ["list"]}', b"[]", b"x" * 2_000_000]
)
def test_unreadable_meta_is_discarded_not_crashed_on(
    dump_dir: Path, staging: Path, meta: bytes
) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    path = make(dump_dir, 1, IDS, "r")
    (path / META_FILE).write_bytes(meta)
    decided, dropped = m.poll(now=0.0)
    assert decided == [] and [w for w, _, _ in dropped] == ["unreadable"]


# ---------------------------------------------------------------------------- chunk book


def job(jid: str, ids: list[str]) -> ChunkJob:
    e = IndexEntry(0, 1, 0, 10)
    return ChunkJob(jid, "q", [(i, e) for i in ids], 0, None)


def test_a_chunk_finishes_only_when_every_sample_is_settled() -> None:
    book = ChunkBook()
    book.add(job("j1", ["a", "b", "c"]), done={"b"})
    a, c = book.next_item(), book.next_item()
    assert a is not None and c is not None and (a.sample_id, c.sample_id) == ("a", "c")
    assert book.next_item() is None
    assert book.resolve(a) is None
    chunk = book.resolve(c)
    assert chunk is not None and chunk.job.job_id == "j1"


def test_a_handed_back_sample_keeps_its_chunk_from_finishing() -> None:
    book = ChunkBook()
    book.add(job("j1", ["a", "b"]), done=set())
    a, b = book.next_item(), book.next_item()
    assert a is not None and b is not None
    book.hand_back(a)
    assert book.resolve(b) is None
    [chunk] = book.clear()
    assert chunk.hand_back


# ---------------------------------------------------------------------------- HTTP client


def client_for(handler: httpx.MockTransport) -> ServerClient:
    return ServerClient("http://srv", transport=handler)


def test_generate_answer_over_the_size_limit_is_refused() -> None:
    big = b'{"meta_info": {"prompt_tokens": 3}, "pad": "' + b"x" * MAX_ANSWER_BYTES + b'"}'
    c = client_for(httpx.MockTransport(lambda _r: httpx.Response(200, content=big)))
    with pytest.raises(errors.ServerRejectedError) as info:
        c.prefill([1, 2, 3], "r")
    assert info.value.status_code == 502 and "over" in str(info.value)


def test_generate_answers_map_to_typed_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        code = {"a": 200, "b": 503, "c": 500, "d": 400}[body["rid"]]
        return httpx.Response(code, json={"meta_info": {"prompt_tokens": 3}})

    c = client_for(httpx.MockTransport(handler))
    assert c.prefill([1, 2, 3], "a").prompt_tokens == 3
    with pytest.raises(errors.ServerUnavailableError):
        c.prefill([1], "b")
    for rid, code in (("c", 500), ("d", 400)):
        with pytest.raises(errors.ServerRejectedError) as info:
            c.prefill([1], rid)
        assert info.value.status_code == code


# ---------------------------------------------------------------------------- dump dir


def test_a_sticky_shared_dump_dir_is_refused_and_left_alone(tmp_path: Path) -> None:
    """The worker chmodded /dev/shm to 0700 and emptied it."""
    shared = tmp_path / "shm"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "req_1").mkdir()
    with pytest.raises(errors.ConfigError, match="sticky"):
        check_dump_dir(shared, force=False)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and (shared / "req_1").exists()
    assert check_dump_dir(shared, force=True) is False
    assert check_dump_dir(tmp_path / "new", force=False) is True


def test_a_file_as_dump_dir_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(errors.ConfigError, match="not a directory"):
        check_dump_dir(f, force=True)


def test_a_short_dump_seen_late_still_waits_for_its_other_part(
    dump_dir: Path, staging: Path
) -> None:
    # The reference server writes its dumps after answering: under load the first part
    # may only show up after the grace has passed since the answer.
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    m.answered("r", now=0.0)
    make(dump_dir, 1, IDS[:6], "r", input_fingerprint="x")
    assert m.poll(now=1.0)[0] == []
    make(dump_dir, 2, IDS[6:], "r", input_fingerprint="x")
    [d], _ = m.poll(now=1.1)
    assert isinstance(d.error, errors.MultipleDumpsError)


def test_worker_metrics_bind_loopback_unless_told_otherwise() -> None:
    """The metrics endpoint was 0.0.0.0 by default."""
    from hsq.workers.settings import WorkerSettings

    s = WorkerSettings(run="r", server="http://x", dump_dir=Path("/nonexistent"), redis_url="")
    assert s.tuning.metrics_host == "127.0.0.1"


# ---------------------------------------------------------------------------- hostile dump dir


def test_only_regular_files_are_opened_in_a_dump_dir(tmp_path: Path) -> None:
    """Item 7: a FIFO blocked open() (and the dispatcher's lock with it); a link may lead
    out of the dump dir. open_regular refuses both without blocking."""
    (tmp_path / "file").write_bytes(b"ok")
    os.close(open_regular(tmp_path / "file"))
    os.mkfifo(tmp_path / "fifo")  # no writer: a plain open() would block for good
    os.symlink(tmp_path / "file", tmp_path / "link")
    (tmp_path / "dir").mkdir()
    for name, kind in (("fifo", "a FIFO"), ("link", "a symlink"), ("dir", "a directory")):
        with pytest.raises(errors.CorruptDumpError, match=f"not a regular file \\({kind}\\)"):
            open_regular(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")


def test_fifos_as_meta_marker_or_tensors_are_errors_not_hangs(
    dump_dir: Path, staging: Path
) -> None:
    path = make(dump_dir, 1, IDS, "r")
    meta = read_meta(path)
    (path / TENSOR_FILE).unlink()
    os.mkfifo(path / TENSOR_FILE)
    with pytest.raises(errors.CorruptDumpError, match="FIFO"):
        open_dump_tensors(path, meta)
    (path / META_FILE).unlink()
    os.mkfifo(path / META_FILE)
    with pytest.raises(errors.CorruptDumpError, match="FIFO"):
        read_meta(path)
    os.mkfifo(dump_dir / READY_FILE)
    with pytest.raises(errors.HookInactiveError, match="FIFO"):
        read_ready(dump_dir)
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    decided, dropped = m.poll(now=0.0)
    assert decided == [] and [w for w, _, _ in dropped] == ["unreadable"]
    assert not (dump_dir / "req_1").exists()


def test_a_staged_dump_that_vanished_is_the_environments_fault(dump_dir: Path) -> None:
    """Item 11: the staging dir moved away with the dump dir while a dump waited there."""
    path = make(dump_dir, 1, IDS, "r")
    meta = read_meta(path)
    path.rename(dump_dir / "elsewhere")
    with pytest.raises(errors.DumpDirError, match="vanished"):
        open_dump_tensors(path, meta)


def test_links_files_and_fifos_under_dump_names_are_unlinked_once_never_followed(
    dump_dir: Path, staging: Path, tmp_path: Path
) -> None:
    """Item 8: a req_* link to a directory, or a plain file, was never removed (rmtree
    refuses both): ~300 warnings a second and a counter without bound."""
    target = tmp_path / "target"
    target.mkdir()
    (target / META_FILE).write_text("{}")
    (target / DONE_FILE).touch()
    os.symlink(target, dump_dir / "req_1")
    (dump_dir / "req_2").write_text("junk")
    os.mkfifo(dump_dir / "req_3")
    os.symlink(target, dump_dir / "req_4.tmp")
    m = matcher(dump_dir, staging)
    _, dropped = m.poll(now=0.0)
    assert sorted((p.name, w) for w, p, _ in dropped) == [
        ("req_1", "not_a_dump"),
        ("req_2", "not_a_dump"),
        ("req_3", "not_a_dump"),
        ("req_4.tmp", "not_a_dump"),
    ]
    assert m.poll(now=0.1) == ([], []) and m.discarded == {"not_a_dump": 4}
    assert not list(dump_dir.iterdir())
    assert sorted(p.name for p in target.iterdir()) == [DONE_FILE, META_FILE]  # not followed
    assert not m.proven  # none of that is a dump writer's work


def test_an_entry_that_cannot_be_removed_is_reported_once_then_skipped(
    dump_dir: Path, staging: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(dump_dir, 1, IDS, "someone-else")
    monkeypatch.setattr(ridmatch, "remove_dump", lambda _path: False)
    m = matcher(dump_dir, staging)
    _, dropped = m.poll(now=0.0)
    assert [w for w, _, _ in dropped] == ["unremovable"]
    for i in range(5):
        assert m.poll(now=0.1 * i) == ([], [])
    assert m.discarded == {"unremovable": 1}
    # The same name with another inode is a new entry and is looked at again.
    monkeypatch.undo()
    remove_dump(dump_dir / "req_1")
    make(dump_dir, 1, IDS, "someone-else")
    assert [w for w, _, _ in m.poll(now=1.0)[1]] == ["unknown_rid"]


def test_a_second_full_dump_after_the_first_was_taken_fails_the_attempt(
    dump_dir: Path, staging: Path
) -> None:
    """Item 12: the first dump was accepted and the second discarded as late."""
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS))
    m.add("s", len(IDS))
    make(dump_dir, 1, IDS, "r")
    make(dump_dir, 2, IDS, "s")
    decided, _ = m.poll(now=0.0)
    assert {d.rid for d in decided if d.dump} == {"r", "s"}
    make(dump_dir, 3, IDS, "r")  # the second dump carrying r
    assert [(w, rid) for w, _, rid in m.poll(now=0.1)[1]] == [("duplicate", "r")]
    with pytest.raises(errors.MultipleDumpsError, match="second dump"):
        m.confirm_single("r")
    m.confirm_single("s")  # one dump: fine
    make(dump_dir, 4, IDS, "s")  # after its use: late, it cannot fail anything now
    assert [w for w, _, _ in m.poll(now=0.2)[1]] == ["late"]


def test_the_hook_is_proven_live_only_by_something_a_dump_writer_made(
    dump_dir: Path, staging: Path
) -> None:
    m = matcher(dump_dir, staging)
    m.poll(now=0.0)
    assert not m.proven
    (dump_dir / "req_7.tmp").mkdir()  # a writer at work
    m.poll(now=0.1)
    assert m.proven
    m.reset_proof()
    assert not m.proven


def dispatcher(dump_dir: Path, timeout: float = 1.0) -> Dispatcher:
    (dump_dir / STAGING).mkdir(exist_ok=True)
    d = Dispatcher(dump_dir, dump_dir / STAGING, timeout_s=timeout)
    d.start()
    return d


def test_no_dump_while_nothing_was_ever_written_is_hook_inactive_not_the_samples(
    dump_dir: Path,
) -> None:
    """Item 9: a stale readiness marker vouched for a server that writes no dumps here, and
    every sample died as no_dump. Until a dump writer has made anything in the dump dir,
    an answered request without a dump says the hook is not live (the worker exits 2)."""
    d = dispatcher(dump_dir, timeout=0.2)
    try:
        t = d.register("r1", len(IDS))
        d.answered("r1")
        with pytest.raises(errors.HookInactiveError, match="not from a live dump hook"):
            d.wait(t, lambda: True)
        t = d.register("r2", len(IDS))
        make(dump_dir, 1, IDS, "r2")  # the hook proves itself
        d.answered("r2")
        assert d.wait(t, lambda: True).meta.rid == "r2"
        t = d.register("r3", len(IDS))
        d.answered("r3")
        with pytest.raises(errors.NoDumpError):  # now a missing dump is the sample's
            d.wait(t, lambda: True)
        assert d.clear() == 0  # a server that came back proves itself again
        t = d.register("r4", len(IDS))
        d.answered("r4")
        with pytest.raises(errors.HookInactiveError):
            d.wait(t, lambda: True)
    finally:
        d.stop()


@pytest.mark.parametrize("order", ["delivered_then_failed", "failed_before_delivery"])
def test_a_dump_matched_to_a_request_that_then_failed_is_removed_not_left_staged(
    dump_dir: Path, order: str
) -> None:
    """A server may write a request's dump and then fail the request (close the connection
    under it): the dump was matched and moved to staging before the worker knew. Whether
    its delivery came before the worker gave the request up or after, it is removed."""
    staging = dump_dir / STAGING
    staging.mkdir()
    d = Dispatcher(dump_dir, staging, timeout_s=5.0)  # no thread: polled by hand
    t = d.register("r", len(IDS))
    make(dump_dir, 1, IDS, "r")
    if order == "delivered_then_failed":
        d._poll_once()
        assert t.match is not None and t.match.dump is not None
        d.abandon(t)
    else:
        with d._cond:
            decided, dropped = d._poll_locked()
        d.abandon(t)  # between the decision (under the lock) and the delivery
        d._deliver(decided, dropped)
    assert list(staging.iterdir()) == []
    assert list(dump_dir.glob("req_*")) == []


@pytest.mark.parametrize("change", ["removed", "recreated", "link"])
def test_a_replaced_dump_dir_fails_waiting_requests_as_the_environments_fault(
    tmp_path: Path, change: str
) -> None:
    """Item 11: requests in flight fail with DumpDirError (handed back, never dead), no
    request is taken until the worker took the directory again, then all is as before."""
    dump = tmp_path / "dumps"
    dump.mkdir(mode=0o700)
    d = dispatcher(dump, timeout=30)
    try:
        t = d.register("r", len(IDS))
        dump.rename(tmp_path / "away")
        if change == "recreated":
            dump.mkdir(mode=0o700)
        elif change == "link":
            (tmp_path / "other").mkdir(mode=0o700)
            dump.symlink_to(tmp_path / "other")
        with pytest.raises(errors.DumpDirError):
            d.wait(t, lambda: True)
        assert d.broken is not None
        with pytest.raises(errors.DumpDirError):
            d.register("r2", len(IDS))
        settings = WorkerSettings(run="r", server="http://x", dump_dir=dump, redis_url="")
        if change == "removed":  # at start a missing dump dir is refused, nothing made
            with pytest.raises(errors.ConfigError, match="does not exist"):
                take_dump_dir(settings, "w")
            assert not dump.exists()
        # As HeldDumpDir.retake: a dir removed under a running worker is made again.
        lock, staging, _ = take_dump_dir(settings, "w", create_missing=True)
        d.retake(staging)
        assert d.broken is None
        t = d.register("r3", len(IDS))
        make(dump, 1, IDS, "r3")
        d.answered("r3")
        assert d.wait(t, lambda: True).path == staging / "r3"
        lock.release()
    finally:
        d.stop()


@pytest.mark.parametrize(
    ("mode", "ok"),
    [(0o700, True), (0o755, True), (0o750, True), (0o777, False), (0o770, False), (0o702, False)],
)
def test_a_dump_dir_writable_by_other_users_is_refused(tmp_path: Path, mode: int, ok: bool) -> None:
    """Item 10: mode 0777 (not sticky, ours) was accepted; another local user could plant
    FIFOs or a forged readiness marker."""
    d = tmp_path / "dumps"
    d.mkdir()
    os.chmod(d, mode)
    if ok:
        assert check_dump_dir(d, force=False) is False
    else:
        with pytest.raises(errors.ConfigError, match=f"writable by other users.*chmod 700 {d}"):
            check_dump_dir(d, force=False)
        assert check_dump_dir(d, force=True) is False
    assert stat.S_IMODE(d.stat().st_mode) == mode


def test_the_lock_file_is_never_a_link_or_a_fifo(tmp_path: Path) -> None:
    """A planted link as the lock file made the worker truncate its target."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    d = tmp_path / "dumps"
    d.mkdir()
    os.symlink(victim, d / LOCK_NAME)
    with pytest.raises(errors.ConfigError, match="lock"):
        DumpDirLock(d).acquire("w")
    assert victim.read_text() == "precious"
    (d / LOCK_NAME).unlink()
    os.mkfifo(d / LOCK_NAME)
    with pytest.raises(errors.ConfigError, match="not a regular file"):
        DumpDirLock(d).acquire("w")


def test_a_held_lock_names_its_holder_with_a_utc_time_not_an_epoch(tmp_path: Path) -> None:
    """The refusal printed the lock file's JSON: `"since": 1764612345.12`."""
    d = tmp_path / "dumps"
    d.mkdir()
    held = DumpDirLock(d)
    held.acquire("node-0")  # flock is per open file: a second open in this process is refused
    try:
        with pytest.raises(errors.ConfigError, match="owned by another live worker") as exc:
            DumpDirLock(d).acquire("node-1")
    finally:
        held.release()
    text = str(exc.value)
    assert re.search(r"worker node-0, pid \d+ on .+, since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", text)
    assert not re.search(r"\d{10}\.\d", text), text


def test_a_planted_staging_link_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    d = tmp_path / "dumps"
    d.mkdir(mode=0o700)
    os.symlink(victim, d / STAGING)
    settings = WorkerSettings(run="r", server="http://x", dump_dir=d, redis_url="")
    lock, staging, _ = take_dump_dir(settings, "w")
    try:
        assert staging.is_dir() and not staging.is_symlink()
        assert [p.name for p in victim.iterdir()] == ["keep"]
    finally:
        lock.release()


def test_dispatcher_threads_never_wait_on_a_fifo(dump_dir: Path) -> None:
    """The heartbeat reads the discard counts without the dispatcher's lock."""
    d = dispatcher(dump_dir)
    try:
        (dump_dir / "req_5").mkdir()
        os.mkfifo(dump_dir / "req_5" / META_FILE)
        (dump_dir / "req_5" / DONE_FILE).touch()
        t = d.register("r", len(IDS))  # wakes the dispatcher; it must not block in open()
        make(dump_dir, 6, IDS, "r")
        d.answered("r")
        assert d.wait(t, lambda: True).meta.rid == "r"
        seen: list[dict[str, int]] = []
        reader = threading.Thread(target=lambda: seen.append(d.discarded), daemon=True)
        reader.start()
        reader.join(10)
        assert seen == [{"unreadable": 1}]
    finally:
        d.stop()


def test_a_matcher_bug_hands_waiting_requests_back_it_never_charges_them(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception from the matcher was logged and polling went on, so every
    request in flight timed out as no_dump and ended in the dead letter: a bug in the worker
    charged to the samples. Now a waiting request fails with an error the policy hands back
    (the worker stops once its work is back), and no new request is taken."""

    def broken_poll(self: RidMatcher, _now: float) -> Any:
        if self.wanted:
            raise KeyError("a bug in the matcher")
        return [], []

    monkeypatch.setattr(RidMatcher, "poll", broken_poll)
    d = dispatcher(dump_dir, timeout=0.2)
    try:
        t = d.register("r1", len(IDS))
        make(dump_dir, 1, IDS, "r1")
        d.answered("r1")
        with pytest.raises(errors.HsqError) as raised:
            d.wait(t, lambda: True)
        decision = decide(classify(raised.value), attempt=0, max_attempts=1)
        assert decision.outcome is Outcome.HAND_BACK, raised.value
        assert decision.pause is Pause.INTERNAL_ERROR
        assert "a bug in the matcher" in str(raised.value)
        assert d.failed is not None
        with pytest.raises(errors.InternalError):
            d.register("r2", len(IDS))
    finally:
        d.stop()


def test_a_dump_dir_that_cannot_be_listed_is_the_environments_fault(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError while scanning the dump dir (EACCES, EIO) is the directory's, not the
    samples': waiting requests fail with DumpDirError (handed back, the dir taken again)."""

    def unreadable(self: RidMatcher, _now: float) -> Any:
        if self.wanted:
            raise PermissionError(13, "Permission denied", str(dump_dir))
        return [], []

    monkeypatch.setattr(RidMatcher, "poll", unreadable)
    d = dispatcher(dump_dir, timeout=0.2)
    try:
        t = d.register("r1", len(IDS))
        d.answered("r1")
        with pytest.raises(errors.DumpDirError, match="Permission denied"):
            d.wait(t, lambda: True)
        assert d.broken is not None
    finally:
        d.stop()
