"""The worker's claim bookkeeping (hsq/workers/claims.py) on the shipped in-memory store:
pure logic, no Redis (tests/test_store_reliability.py has the real lost reply)."""

from __future__ import annotations

from hsq.dataset.jsonl import IndexEntry
from hsq.outputs.manifest import ManifestEntry
from hsq.runconfig import RunConfig
from hsq.store import MemoryRun, MemoryStore
from hsq.workers.claims import Claims

ENTRY = IndexEntry(0, 10, 0, 3)


def test_a_job_stranded_in_the_wip_list_is_handed_out_first_and_only_once() -> None:
    """A claim whose reply was lost leaves its job in the worker's wip list, unknown to the
    worker (redis-py retries the command): Claims hands it out next instead of stranding it,
    and a job it handed out is never handed out again while held."""
    run = MemoryRun[ManifestEntry]()
    operator, store = MemoryStore(run), MemoryStore(run)
    operator.create_config(RunConfig(run="r", dataset="/d.jsonl", out="/out"))
    operator.enqueue([[("a", ENTRY)], [("b", ENTRY)], [("c", ENTRY)]])
    lost = store.claim("w", 0)  # the job moved into wip; its reply never arrived
    assert lost is not None
    claims = Claims(store, "w")
    assert claims.claim(0) == lost
    second = claims.claim(0)
    assert second is not None and second.samples[0][0] == "b"
    assert claims.finish(lost) and claims.give_back(second)
    assert not claims.finish(lost)  # not ours any more
    third = claims.claim(0)
    assert third is not None and third.samples[0][0] == "b"  # given back to the front
    assert claims.release_all() == 1
    assert store.held == {}
    assert [j.samples[0][0] for j in run.main] == ["b", "c"]
