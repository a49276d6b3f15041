"""The enqueue of a large dataset. The chunk size left at its default grows
with the dataset; a re-enqueue writes only the index entries that changed; the index a new
run gets from the scan's packed writes is the dataset scan's. Real redis-server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsq.dataset.jsonl import scan_dataset
from hsq.producer import enqueue as enq
from hsq.producer.enqueue import auto_chunk_size, enqueue_run
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store.connection import text
from tests.helpers import store


def write(path: Path, ids: list[str]) -> None:
    path.write_text("".join(json.dumps({"id": s, "input_ids": [1, len(s), 3]}) + "\n" for s in ids))


def index_of(st: RunStore) -> dict[str, str]:
    raw = st.client.hgetall(st.keys.index)
    return {text(k): text(v) for k, v in raw.items()}


def scanned(path: Path) -> dict[str, str]:
    return {
        str(x.sample_id): x.entry.encode() for x in scan_dataset(path) if x.entry and not x.error
    }


def queued_ids(st: RunStore) -> list[str]:
    return sorted(st.outstanding_samples())


def test_the_default_chunk_size_grows_with_the_dataset() -> None:
    assert auto_chunk_size(0) == auto_chunk_size(100_000) == 16
    assert auto_chunk_size(1_000_000) == 64  # 15,625 jobs
    assert auto_chunk_size(10_000_000) == 1024  # 9,766 jobs
    assert auto_chunk_size(10**9) == 1024  # at most
    for lines in (200_000, 3_000_000, 9_000_000):
        size = auto_chunk_size(lines)
        assert lines / size >= enq.JOBS_TARGET and lines / (2 * size) < enq.JOBS_TARGET


def test_a_chunk_size_left_at_its_default_follows_the_dataset_and_a_given_one_is_kept(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(enq, "JOBS_TARGET", 4)  # 200 lines: 4+ jobs of 32
    ds = tmp_path / "d.jsonl"
    ids = [f"s{i:03d}" for i in range(200)]
    write(ds, ids)
    auto = store(redis_url, "auto")
    cfg = RunConfig(run="auto", dataset=str(ds), out=str(tmp_path / "o"))
    report = enqueue_run(auto, cfg, progress=False, defaulted=["chunk_size"])
    assert (report.enqueued, report.chunks) == (200, 7)  # 6 of 32 and one of 8
    assert auto.require_config().chunk_size == 32  # recorded: requeue makes jobs of it too
    assert auto.queue_lengths()["main"] == 7 and queued_ids(auto) == ids
    given = store(redis_url, "given")
    cfg = RunConfig(run="given", dataset=str(ds), out=str(tmp_path / "o"), chunk_size=16)
    report = enqueue_run(given, cfg, progress=False, defaulted=[])
    assert report.chunks == 13 and given.require_config().chunk_size == 16


def test_a_re_enqueue_rewrites_the_index_entries_that_changed_and_only_adds_new_samples(
    tmp_path: Path, redis_url: str
) -> None:
    ds = tmp_path / "d.jsonl"
    ids = [f"s{i:03d}" for i in range(50)]
    write(ds, ids)
    st = store(redis_url, "re")
    cfg = RunConfig(run="re", dataset=str(ds), out=str(tmp_path / "o"))
    assert enqueue_run(st, cfg, progress=False).enqueued == 50
    assert index_of(st) == scanned(ds)  # the scan's packed writes: the dataset scan's entries
    st.client.hset(st.keys.index, "s010", "damaged")  # Redis is untrusted
    assert enqueue_run(st, cfg, progress=False).enqueued == 0
    assert index_of(st) == scanned(ds)  # the damaged entry written again
    # A line in front moves every offset; a new sample is enqueued, nothing else.
    write(ds, ["new", *ids])
    report = enqueue_run(st, cfg, progress=False)
    assert (report.enqueued, report.outstanding) == (1, 50)
    assert index_of(st) == scanned(ds)
    assert queued_ids(st) == sorted(["new", *ids])


def test_commands_packed_per_key_are_what_hiredis_packs_for_each(redis_url: str) -> None:
    from hsq.store.connection import connect, pack, pack_per_key, send_packed_many

    args = ["a", "", "\u00e9t\u00e9", "x" * 300, "s\r\n1"]
    keys = ["k1", "key:\u00e9", "k" * 40]
    packed = pack_per_key("HMGET", keys, args)
    assert packed == [pack("HMGET", key, *args) for key in keys]
    client = connect(redis_url)
    client.hset("k1", mapping={"a": "1", "s\r\n1": "2"})
    replies = send_packed_many(client, packed)
    assert replies == [[b"1", None, None, None, b"2"], [None] * 5, [None] * 5]
