"""One set of cases, two stores: the shipped in-memory fake (hsq.store.MemoryStore) and the
Redis store on a real redis-server. The fake promises the real store's semantics wherever a
worker can tell (hsq/store/memory.py); every unit test of the worker's logic leans on that
promise, so it is checked here case by case against the real thing.

Each case gets two clients of one run, as in production: the operator's (config, enqueue,
purge) and a worker's (claim, mark, settle).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from hsq.dataset.jsonl import IndexEntry
from hsq.errors import RunChangedError
from hsq.outputs.manifest import ManifestEntry
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import MemoryRun, MemoryStore, WorkerStore, connect
from hsq.store.jobs import ChunkJob

INDEX = IndexEntry(0, 10, 0, 3)
WAIT = 0.05
"""Seconds a claim on an empty queue waits (never 0: Redis reads 0 as "block forever")."""


def entry(sid: str, worker: str = "w") -> ManifestEntry:
    return ManifestEntry(f"00/{sid}.safetensors", 3, 100, "x" * 16, worker, 1.0, 0)


@dataclass
class Pair:
    operator: Any
    worker: WorkerStore[ManifestEntry]
    kind: str

    def dead_ids(self) -> set[str]:
        if isinstance(self.operator, MemoryStore):
            return set(self.operator.dead)
        return set(self.operator.dead_entries())

    def recreate(self) -> None:
        """The operator purges the run and creates it again: a new generation."""
        if isinstance(self.operator, MemoryStore):
            self.operator.purge()
        else:
            self.operator.lifecycle.purge()
        self.operator.create_config(config())


def config() -> RunConfig:
    return RunConfig(run="c", dataset="/d.jsonl", out="/out")


@pytest.fixture(params=["memory", "redis"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    if request.param == "memory":
        run = MemoryRun[ManifestEntry](name="c")
        p = Pair(MemoryStore(run), MemoryStore(run), "memory")
    else:
        url = request.getfixturevalue("redis_url")
        p = Pair(RunStore(connect(url), "c"), RunStore(connect(url), "c"), "redis")
    p.operator.create_config(config())
    p.worker.require_config()  # the worker's fence takes the run's generation
    yield p


def samples(job: ChunkJob | None) -> list[str]:
    assert job is not None
    return [sid for sid, *_ in job.samples]


def test_the_retry_queue_is_claimed_before_the_main_queue_each_in_order(pair: Pair) -> None:
    op, w = pair.operator, pair.worker
    op.enqueue([[("a", INDEX)], [("b", INDEX)]])
    op.enqueue([[("r", INDEX)]], retry=True, attempt=1, reason="server_error")
    assert samples(w.claim("w1", WAIT)) == ["r"]
    assert samples(w.claim("w1", WAIT)) == ["a"]
    assert samples(w.claim("w1", WAIT)) == ["b"]
    assert w.claim("w1", WAIT) is None


def test_a_job_is_held_by_its_claimer_until_finished_or_given_back(pair: Pair) -> None:
    op, w = pair.operator, pair.worker
    op.enqueue([[("a", INDEX)], [("b", INDEX)]])
    first = w.claim("w1", WAIT)
    assert first is not None and w.held_job_ids("w1") == [first.job_id]
    assert w.load_held("w1", first.job_id) == first
    assert not w.finish("w2", first)  # not w2's
    assert w.give_back("w1", first)
    assert not w.give_back("w1", first)  # not held any more
    again = w.claim("w2", WAIT)
    assert again == first  # given back to the front
    assert w.finish("w2", again) and not w.finish("w2", again)
    assert not w.nothing_outstanding()  # "b" still queued
    assert samples(w.claim("w1", WAIT)) == ["b"]
    assert w.release_wip("w1") == 1  # a stopping worker's jobs go back
    assert samples(w.claim("w2", WAIT)) == ["b"]


def test_an_empty_run_has_nothing_outstanding_once_its_jobs_are_finished(pair: Pair) -> None:
    """A registered worker's held job is outstanding (the Redis store looks at the wip lists
    of the workers it knows, as a worker registers before it claims)."""
    op, w = pair.operator, pair.worker
    w.register("w1", {"host": "test"})
    op.enqueue([[("a", INDEX), ("b", INDEX)]])
    job = w.claim("w1", WAIT)
    assert job is not None and not w.nothing_outstanding()
    assert w.finish("w1", job)
    assert w.nothing_outstanding()


def test_marks_are_idempotent_and_done_and_dead_stay_disjoint(pair: Pair) -> None:
    w = pair.worker
    assert w.mark_done_many([("a", entry("a")), ("b", entry("b"))]) == [True, True]
    assert w.mark_done_many([("a", entry("a", "other"))]) == [False]
    assert w.get_manifest("a") == entry("a")  # the first mark stands
    assert w.done_among(["a", "b", "c"]) == {"a", "b"}
    w.to_dead("a", "server_error", "late failure", 3, "w1")
    assert "a" not in pair.dead_ids()  # done wins over a late dead letter
    w.to_dead("c", "bad_dump", "no dump", 3, "w1")
    assert pair.dead_ids() == {"c"}
    assert w.mark_done_many([("c", entry("c"))]) == [True]
    assert pair.dead_ids() == set()  # a sample done later leaves the dead letter


def test_only_a_held_job_s_samples_are_marked(pair: Pair) -> None:
    op, w = pair.operator, pair.worker
    op.enqueue([[("a", INDEX), ("b", INDEX)]])
    job = w.claim("w1", WAIT)
    assert job is not None
    marks = w.mark_held_done(
        "w1", [("a", job.job_id, entry("a")), ("x", "not-a-held-job", entry("x"))]
    )
    assert marks == [True, None]
    assert w.done_among(["a", "x"]) == {"a"}
    assert w.finish("w1", job)
    assert w.mark_held_done("w1", [("b", job.job_id, entry("b"))]) == [None]  # given away


def test_undo_done_removes_a_mark_once(pair: Pair) -> None:
    w = pair.worker
    w.mark_done_many([("a", entry("a"))])
    assert w.undo_done("a", entry("a"))
    assert w.get_manifest("a") is None and w.done_among(["a"]) == set()
    assert not w.undo_done("a", entry("a"))


def test_crashes_are_counted_per_sample(pair: Pair) -> None:
    w = pair.worker
    assert [w.record_crash("a"), w.record_crash("a"), w.record_crash("b")] == [1, 2, 1]


def test_a_worker_s_writes_are_refused_once_the_run_was_recreated(pair: Pair) -> None:
    op, w = pair.operator, pair.worker
    op.enqueue([[("a", INDEX)]])
    job = w.claim("w1", WAIT)
    assert job is not None
    pair.recreate()
    with pytest.raises(RunChangedError):
        w.mark_done_many([("a", entry("a"))])
    with pytest.raises(RunChangedError):
        w.finish("w1", job)
    with pytest.raises(RunChangedError):
        w.to_dead("a", "bad_dump", "x", 1, "w1")
    assert op.done_among(["a"]) == set()
