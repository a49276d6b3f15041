"""The run's stats hash through one typed record (hsq.store.RunStats), the same cases on the
real store (a real redis-server) and on the in-memory one, which promises the same
semantics: what the producer writes, what the queues and the done marks move, read back as
one record; and the hash holds no field the record does not know."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsq.dataset.jsonl import IndexEntry
from hsq.outputs.format import output_relpath
from hsq.outputs.manifest import MANIFEST_CODEC, ManifestEntry
from hsq.runconfig import RunConfig
from hsq.store import MemoryStore, RunStats, StatsKeeper
from hsq.store.counters import STAT_FIELDS, stat_fields
from hsq.store.scripts import COUNTERS_VERSION
from tests.helpers import store

ENTRY = IndexEntry(0, 10, 0, 3)


def done(sid: str, tokens: int, nbytes: int) -> ManifestEntry:
    return ManifestEntry(output_relpath(sid), tokens, nbytes, "crc32:0", "w", 0.0, 0)


@pytest.fixture(params=["redis", "memory"])
def keeper(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A fresh run's store: the real one, or MemoryStore with the manifest's totals."""
    if request.param == "redis":
        st: Any = store(request.getfixturevalue("redis_url"), "stats")
    else:
        st = MemoryStore[ManifestEntry](totals=MANIFEST_CODEC.totals)
    st.create_config(RunConfig(run=st.run, dataset=str(tmp_path / "d.jsonl"), out="/o"))
    yield st


def test_the_counters_round_trip_through_one_record(keeper: Any) -> None:
    st: StatsKeeper = keeper
    assert st.stats() == RunStats(counters=COUNTERS_VERSION)  # a new run: counted from 0
    st.set_totals(samples=9, tokens=90, invalid_lines=2)
    refs = [(f"s{i}", ENTRY) for i in range(9)]
    keeper.enqueue([refs[:4], refs[4:7]])  # two jobs, 7 samples
    keeper.enqueue([refs[7:]], retry=True, attempt=1, reason="x")  # one retry job, 2
    job = keeper.claim("w", 0)  # the retry job first: out of the retry counters
    assert job is not None and len(job.samples) == 2
    keeper.mark_done_many([("s0", done("s0", 3, 100)), ("s1", done("s1", 4, 200))])
    keeper.mark_done_many([("s0", done("s0", 3, 100))])  # twice: counted once
    keeper.undo_done("s1", done("s1", 4, 200))
    st.set_lost(5)
    st.forget_lost(2)
    want = RunStats(
        total_samples=9, total_tokens=90, invalid_lines=2, tokens=3, bytes=100,
        main_samples=7, main_jobs=2, lost=3, counters=COUNTERS_VERSION,
    )  # fmt: skip
    assert st.stats() == want
    st.forget_lost(10)  # never below 0
    assert st.stats().lost == 0
    if isinstance(keeper, MemoryStore):
        return
    raw = keeper.client.hgetall(keeper.keys.stats)
    assert {k.decode() for k in raw} <= STAT_FIELDS  # every field the scripts wrote is known
    assert RunStats.from_hash(raw) == st.stats()


def test_a_field_the_record_does_not_know_is_refused_on_write_and_ignored_on_read() -> None:
    with pytest.raises(KeyError, match="lsot"):
        stat_fields(lsot=1)
    assert RunStats.from_hash({b"tokens": b"7", b"someday": b"1"}) == RunStats(tokens=7)
