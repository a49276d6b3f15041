"""The worker's pure parts in-process, in milliseconds: the failure policy, rid matching
(protocol v2), the chunk book, the HTTP client's limits and the dump dir checks."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import httpx
import pytest

from hsq import errors
from hsq.dataset import IndexEntry
from hsq.protocol import META_FILE, RidMatcher
from hsq.store import ChunkJob
from hsq.workers.chunks import ChunkBook
from hsq.workers.client import MAX_ANSWER_BYTES, MidRequestFailure, ServerClient
from hsq.workers.policy import Kind, Outcome, Pause, backoff, classify, decide
from hsq.workers.startup import check_dump_dir
from tests.test_protocol import IDS, make

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
        (errors.StoreUnavailableError("x"), Kind.PAUSE, "store_unavailable"),
        (errors.RunChangedError("x"), Kind.RUN_CHANGED, "run_changed"),
        (AttributeError("'int' object has no attribute 'get'"), Kind.SAMPLE, "internal_error"),
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
        m.add(rid, len(IDS), now=0.0)
    make(dump_dir, 5, IDS, "c")
    make(dump_dir, 6, IDS, "a")
    decided, dropped = m.poll(now=0.0)
    assert {d.rid: d.dump.path.name for d in decided if d.dump} == {"a": "a", "c": "c"}
    assert not dropped and set(m.wanted) == {"b"}
    assert sorted(p.name for p in staging.iterdir()) == ["a", "c"]
    assert not list(dump_dir.iterdir())  # moved out: no later scan sees them


def test_unknown_rid_is_removed_and_counted_never_attributed(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("mine", len(IDS), now=0.0)
    make(dump_dir, 1, IDS, "WARMUP_0")
    decided, dropped = m.poll(now=0.0)
    assert decided == [] and [(w, r) for w, _, r in dropped] == [("unknown_rid", "WARMUP_0")]
    assert m.discarded == {"unknown_rid": 1} and not list(dump_dir.iterdir())


def test_two_dumps_for_one_rid_fail_it_with_multiple_dumps(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS), now=0.0)
    make(dump_dir, 1, IDS, "r")
    make(dump_dir, 2, IDS, "r")
    [d], _ = m.poll(now=0.0)
    assert isinstance(d.error, errors.MultipleDumpsError) and d.error.reason == "multiple_dumps"
    assert not list(dump_dir.iterdir())


def test_a_split_prefill_is_caught_even_when_its_parts_land_apart(
    dump_dir: Path, staging: Path
) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS), now=0.0)
    make(dump_dir, 1, IDS[:6], "r", input_fingerprint="x")  # first chunk of the prefill
    m.answered("r", now=0.0)
    assert m.poll(now=0.05) == ([], [])  # short: held for the rest
    make(dump_dir, 2, IDS[6:], "r", input_fingerprint="x")
    [d], _ = m.poll(now=0.1)
    assert isinstance(d.error, errors.MultipleDumpsError)


def test_a_short_dump_alone_is_delivered_after_the_grace(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS), now=0.0)
    make(dump_dir, 1, IDS[:6], "r")
    m.answered("r", now=0.0)
    assert m.poll(now=0.1)[0] == []
    [d], _ = m.poll(now=0.5)
    assert d.dump is not None and d.dump.meta.num_tokens == 6  # check_meta: wrong_length


def test_late_dump_after_a_timeout_is_discarded_and_fails_nothing_else(
    dump_dir: Path, staging: Path
) -> None:
    """Issue 15, D8: one late dump sent 6 of the next 8 samples to the dead letter."""
    m = matcher(dump_dir, staging, timeout=1.0)
    m.add("old", len(IDS), now=0.0)
    m.answered("old", now=0.0)
    [d], _ = m.poll(now=2.0)
    assert isinstance(d.error, errors.NoDumpError)
    for i in range(8):
        m.add(f"next{i}", len(IDS), now=2.0)
    make(dump_dir, 1, IDS, "old")  # the late one lands among the next requests
    for i in range(8):
        make(dump_dir, 2 + i, IDS, f"next{i}")
    decided, dropped = m.poll(now=2.1)
    assert [(w, r) for w, _, r in dropped] == [("late", "old")]
    assert len(decided) == 8 and all(x.dump is not None for x in decided)


def test_abandoned_rid_dump_is_late(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS), now=0.0)
    m.abandon("r")
    make(dump_dir, 1, IDS, "r")
    assert [w for w, _, _ in m.poll(now=0.0)[1]] == ["late"]
    with pytest.raises(ValueError):
        m.add("r", len(IDS), now=0.0)  # a rid is never reused


def test_renamed_dump_without_done_fails_its_rid_at_once(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging)
    m.add("r", len(IDS), now=0.0)
    make(dump_dir, 1, IDS, "r", mark_done=False)
    [d], _ = m.poll(now=0.0)
    assert isinstance(d.error, errors.IncompleteDumpError)


def test_timeout_says_stale_when_foreign_dumps_came_instead(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging, timeout=1.0)
    m.add("r", len(IDS), now=0.0)
    m.answered("r", now=0.0)
    make(dump_dir, 1, IDS, "someone-else")
    assert m.poll(now=0.5)[0] == []
    [d], _ = m.poll(now=1.5)
    assert isinstance(d.error, errors.StaleDumpError)


def test_timeout_is_counted_from_the_answer_not_the_send(dump_dir: Path, staging: Path) -> None:
    m = matcher(dump_dir, staging, timeout=1.0)
    m.add("r", len(IDS), now=0.0)
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
    m.add("r", len(IDS), now=0.0)
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
    assert book.resolve(b) is None and book.finishable() == []
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
    """Issue 15, D7: the worker chmodded /dev/shm to 0700 and emptied it."""
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
    m.add("r", len(IDS), now=0.0)
    m.answered("r", now=0.0)
    make(dump_dir, 1, IDS[:6], "r", input_fingerprint="x")
    assert m.poll(now=1.0)[0] == []
    make(dump_dir, 2, IDS[6:], "r", input_fingerprint="x")
    [d], _ = m.poll(now=1.1)
    assert isinstance(d.error, errors.MultipleDumpsError)


def test_worker_metrics_bind_loopback_unless_told_otherwise() -> None:
    """Issue 15 minor item: the metrics endpoint was 0.0.0.0 by default."""
    from hsq.workers.settings import WorkerSettings

    s = WorkerSettings(run="r", server="http://x", dump_dir=Path("/nonexistent"), redis_url="")
    assert s.metrics_host == "127.0.0.1"
