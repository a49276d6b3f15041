"""Counters instead of recounts, batched done marks, the fast dataset scan, the
parallel verify, and the scale benchmark's smoke run. Real redis-server throughout."""

from __future__ import annotations

import json
import queue
import random
import subprocess
import sys
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import pytest

from hsq.dataset.jsonl import IndexEntry, scan_dataset
from hsq.errors import RunChangedError
from hsq.keys import rq_queue_key
from hsq.ops import run_status, verify
from hsq.ops.status import partition
from hsq.outputs.format import output_relpath
from hsq.outputs.manifest import ManifestEntry
from hsq.producer.fastscan import scan_batches
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import chunked, job_size
from hsq.store.connection import pack
from hsq.workers.chunks import WorkItem
from hsq.workers.events import Event, EventKind
from hsq.workers.persist.commit import Committer
from tests.helpers import hsq, store
from tests.support.lines import LINES, damaged

ROOT = Path(__file__).resolve().parent.parent
E = IndexEntry(0, 10, 0, 3)


def manifest(sid: str) -> ManifestEntry:
    return ManifestEntry(output_relpath(sid), 3, 100, "crc32:0", "w", 0.0, 0)


def new_run(redis_url: str, run: str, tmp_path: Path, n: int, chunk: int = 4) -> RunStore:
    st = store(redis_url, run)
    st.create_config(RunConfig(run=run, dataset=str(tmp_path / "d.jsonl"), out=str(tmp_path)))
    refs = [(f"s{i:04d}", E) for i in range(n)]
    st.config_index.put_index(refs)
    st.set_totals(samples=n, tokens=3 * n, invalid_lines=0)
    st.enqueue(chunked(refs, chunk))
    return st


def exact(st: RunStore) -> dict[str, int]:
    """The partition by reading every id (what status did before counters)."""
    index, outstanding, done, dead, _ = partition(st)
    places = {"main": 0, "retry": 0, "in_progress": 0}
    for sid in index - done - dead:
        place = outstanding.get(sid)
        if place is not None:
            places["in_progress" if place.startswith("wip:") else place] += 1
    missing = len(index - done - dead - set(outstanding))
    return {
        "done": len(done),
        "dead": len(dead),
        "queued": places["main"],
        "retry": places["retry"],
        "in_progress": places["in_progress"],
        "missing": missing,
    }


def counted(st: RunStore) -> dict[str, int]:
    s = run_status(st)
    return {k: getattr(s, k) for k in ("done", "dead", "queued", "retry", "in_progress", "missing")}


def test_counters_agree_with_a_full_recount_through_every_kind_of_move(
    tmp_path: Path, redis_url: str
) -> None:
    st = new_run(redis_url, "cnt", tmp_path, 40)
    assert counted(st) == exact(st) == {**exact(st), "queued": 40}
    job = st.claim("w1", 1)
    assert job is not None and job_size(job.job_id) == 4
    assert counted(st) == exact(st)  # 4 in progress
    assert st.mark_done_many([(sid, manifest(sid)) for sid, _ in job.samples[:3]]) == [True] * 3
    st.to_dead(job.samples[3][0], "wrong_length", "x", 3, "w1")
    assert st.finish("w1", job)
    assert counted(st) == exact(st)
    retried = st.claim("w1", 1)
    assert retried is not None
    st.enqueue([[retried.samples[0]]], retry=True, attempt=1, reason="stale_dump")
    st.mark_done_many([(sid, manifest(sid)) for sid, _ in retried.samples[1:]])
    assert st.finish("w1", retried)
    assert counted(st) == exact(st)  # 1 in the retry queue
    held = st.claim("w2", 1)
    assert held is not None and held.origin == st.keys.retry_queue
    assert st.give_back("w2", held)
    assert counted(st) == exact(st)
    for _ in range(3):
        st.claim("w3", 1)
    assert st.release_wip("w3") == 3
    assert counted(st) == exact(st)
    st.register("w4", {"state": "working"})
    st.claim("w4", 1)
    assert counted(st) == exact(st)
    assert sum(counted(st).values()) == 40


def test_a_damaged_queue_is_recounted_and_requeue_missing_clears_the_lost_count(
    tmp_path: Path, redis_url: str
) -> None:
    st = new_run(redis_url, "lost", tmp_path, 20, chunk=3)
    st.client.lpop(rq_queue_key(st.keys.main_queue))  # one job lost from outside
    got = counted(st)
    assert got == exact(st) and got["missing"] == 3 and got["queued"] == 17
    assert st.counts().consistent  # the recount re-derived the counters
    assert "requeued 3" in hsq("requeue", "--run", "lost", "--missing", "--redis", redis_url).stdout
    assert counted(st) == exact(st) and counted(st)["missing"] == 0


def test_a_run_made_before_counters_gets_them_from_one_recount(
    tmp_path: Path, redis_url: str
) -> None:
    st = new_run(redis_url, "old", tmp_path, 12)
    st.to_dead("s0000", "bad", "x", 1, None)
    # An older hsq kept none of these, and its job ids carried no size.
    fields = ["counters", "main_samples", "main_jobs", "retry_samples", "retry_jobs", "lost"]
    st.client.hdel(st.keys.stats, *fields)
    st.client.delete(st.keys.dead_reasons)
    main = rq_queue_key(st.keys.main_queue)
    first = str(st.client.lindex(main, 0), "ascii")  # type: ignore[arg-type]
    st.client.lset(main, 0, first.rsplit("-n", 1)[0])  # a legacy id, same job hash
    st.client.rename(f"rq:job:{first}", f"rq:job:{first.rsplit('-n', 1)[0]}")
    assert not st.counts().consistent
    assert counted(st) == exact(st)
    c = st.counts()
    assert c.consistent and c.stats.main_samples == 12 and c.dead_reasons == {"bad": 1}
    job = st.claim("w", 1)  # the legacy job: its size comes from the job-sizes hash
    assert job is not None and job_size(job.job_id) is None
    assert counted(st) == exact(st)


def test_mark_done_many_is_fenced_idempotent_and_keeps_totals(
    tmp_path: Path, redis_url: str
) -> None:
    st = new_run(redis_url, "many", tmp_path, 8)
    batch = [(f"s{i:04d}", manifest(f"s{i:04d}")) for i in range(5)]
    st.to_dead("s0001", "stale_dump", "x", 3, "w")
    assert st.mark_done_many([*batch, batch[0]]) == [True] * 5 + [False]
    assert st.mark_done_many(batch[:2]) == [False, False]
    assert st.stats().tokens == 15 and st.stats().bytes == 500
    assert st.count(st.keys.dead) == 0 and st.ledger.dead_reasons() == {}  # done leaves the dead
    st.to_dead("s0002", "x", "y", 1, "w")
    assert st.count(st.keys.dead) == 0  # a done sample is not dead-lettered
    assert hsq("purge", "--run", "many", "--yes", "--redis", redis_url).returncode == 0
    with pytest.raises(RunChangedError):
        st.mark_done_many([("s0006", manifest("s0006"))])
    assert st.client.keys("hsq:run:many:*") == []


def test_a_worker_whose_job_was_reaped_marks_none_of_its_samples(
    tmp_path: Path, redis_url: str
) -> None:
    """The done marks are fenced by ownership, in the marking script itself."""
    st = new_run(redis_url, "held", tmp_path, 8)
    st.register("wa", {"state": "x"})
    job = st.claim("wa", 1)
    assert job is not None
    (s0, _), (s1, _) = job.samples[:2]
    assert st.mark_held_done("wa", [(s0, job.job_id, manifest(s0))]) == [True]
    assert st.mark_held_done("wa", [(s0, job.job_id, manifest(s0))]) == [False]
    st.client.delete(st.keys.worker("wa"))  # its heartbeat expired (SIGSTOP)
    assert st.reap() == {"wa": 1}
    assert st.mark_held_done("wa", [(s1, job.job_id, manifest(s1))]) == [None]
    assert st.done_among([s0, s1]) == {s0}
    assert st.stats().tokens == 3  # only s0 counted
    other = st.claim("wb", 1)
    assert other is not None and other.job_id == job.job_id
    assert st.mark_held_done("wb", [(s1, job.job_id, manifest(s1))]) == [True]


def test_one_reaper_at_a_time(tmp_path: Path, redis_url: str) -> None:
    a = new_run(redis_url, "reap", tmp_path, 8)
    b = store(redis_url, "reap")
    b.require_config()
    a.register("dead-w", {"state": "x"})
    a.claim("dead-w", 1)
    a.client.delete(a.keys.worker("dead-w"))  # its heartbeat expired
    results = [a.reap(), b.reap()]
    assert sorted(len(r) for r in results) == [0, 1]
    assert counted(a) == exact(a)


class MarkStore:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[int] = []
        self.fail = fail

    def mark_done(self, _sample_id: str, _entry: ManifestEntry) -> bool:
        raise AssertionError("the committer must use the batch call")

    def mark_done_many(self, entries: Sequence[tuple[str, ManifestEntry]]) -> list[bool]:
        if self.fail is not None:
            raise self.fail
        self.calls.append(len(entries))
        return [True] * len(entries)

    def mark_held_done(
        self, _worker_id: str, entries: Sequence[tuple[str, str, ManifestEntry]]
    ) -> list[bool | None]:
        return list(self.mark_done_many([(sid, e) for sid, _job, e in entries]))


def item(i: int) -> WorkItem:
    return WorkItem((f"s{i}", E), 0, "job")


def test_the_committer_marks_in_batches_and_fails_every_sample_of_a_failed_batch() -> None:
    events: queue.Queue[Event] = queue.Queue()
    ms = MarkStore()
    marked: list[bool] = []
    c = Committer(ms, events, "w", max_batch=4, max_delay_s=3600)
    for i in range(10):
        c.add(item(i), manifest(f"s{i}"), marked.append)
    assert ms.calls == [4, 4]  # full batches go at once; the rest waits for its time
    c.flush()
    assert ms.calls == [4, 4, 2] and marked == [True] * 10
    assert [events.get_nowait().kind for _ in range(10)] == [EventKind.DONE] * 10
    c.close()

    failing = MarkStore(fail=RunChangedError("purged"))
    c = Committer(failing, events, "w", max_batch=64, max_delay_s=0.01)
    c.add(item(1), manifest("s1"), marked.append)
    c.add(item(2), manifest("s2"), marked.append)
    got = [events.get(timeout=30), events.get(timeout=30)]  # flushed by the timer
    assert {e.kind for e in got} == {EventKind.FAILED}
    assert all(isinstance(e.exc, RunChangedError) for e in got)
    c.close()


SPLITS = [(1, 2**20), (1, 1), (1, 7), (1, 61), (2, 53)]
"""(processes, piece bytes) for the fast scan: one piece; pieces starting inside lines, at
line starts and in blank lines; a pool of two processes."""


def compare_scans(
    path: Path, max_tokens: int | None, splits: Sequence[tuple[int, int]] = SPLITS
) -> None:
    for procs, piece in splits:
        compare_scan(path, max_tokens, procs, piece)


def compare_scan(path: Path, max_tokens: int | None, procs: int, piece: int) -> None:
    slow = [
        (x.line_no, x.sample_id, x.entry.encode() if x.entry else None, x.error.reason)
        if x.error
        else (x.line_no, x.sample_id, x.entry.encode() if x.entry else None, None)
        for x in scan_dataset(path, max_tokens)
    ]
    fast_valid: list[tuple[str, str]] = []
    fast_bad: list[tuple[int, str | None, str]] = []
    seen: dict[str, int] = {}
    lines = size = 0
    packed = batches = 0
    scan = scan_batches(
        path, max_tokens, batch=3, seen=seen, procs=procs, piece=piece, index_key="i"
    )
    for b in scan:
        lines += b.lines
        size += b.bytes
        fast_valid += b.valid
        batches += bool(b.valid)
        if b.packed_index is not None:  # the batch's own index write, packed in the scan
            assert b.packed_index == pack("HSET", "i", *chain.from_iterable(b.valid))
            packed += 1
        fast_bad += [(int(k.split(":")[1]), sid, err.reason) for k, err, sid in b.bad]
    assert fast_valid == [(sid, e) for _, sid, e, reason in slow if reason is None]
    assert fast_bad == [(n, sid, reason) for n, sid, _, reason in slow if reason is not None]
    assert lines == len(slow) and size == path.stat().st_size
    first = {sid: n for n, sid, _, reason in reversed(slow) if reason is None}
    assert seen == first  # every valid id with the line it was first met on
    if all(reason != "duplicate_id" for *_, reason in slow):
        assert packed == batches  # no duplicates: every batch's index write came packed


@pytest.mark.parametrize("max_tokens", [None, 4])
def test_the_fast_scan_decides_every_line_as_the_dataset_scan_does(
    tmp_path: Path, max_tokens: int | None
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    compare_scans(path, max_tokens)


def test_the_fast_scan_packs_each_batchs_index_write(tmp_path: Path) -> None:
    """No duplicate: every batch comes with its HSET packed (compare_scan checks its bytes)."""
    from bench.scale import write_dataset

    path = tmp_path / "unique.jsonl"
    write_dataset(path, 500, 1, 6)
    compare_scans(path, None, [(1, 2**20), (1, 61), (2, 4099)])


def test_the_fast_scan_reads_crlf_lines_as_the_dataset_scan_does(tmp_path: Path) -> None:
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(("\r\n".join(LINES) + "\r\n\r\r\n").encode())
    compare_scans(path, None)


def test_the_fast_scan_agrees_on_randomly_damaged_lines(tmp_path: Path) -> None:
    rng = random.Random(26)
    lines = []
    for i in range(3000):
        n = rng.randint(1, 12)
        toks = [rng.choice([0, 1, 7, 10, 999999999, 1000000000, 2147483647]) for _ in range(n)]
        mask = [rng.randint(0, 1) for _ in range(n)]
        sep = rng.choice([(", ", ": "), (",", ":")])
        line = json.dumps({"id": f"r{i}", "input_ids": toks, "loss_mask": mask}, separators=sep)
        for _ in range(rng.randint(0, 2)):  # a few random edits
            pos = rng.randrange(len(line))
            line = line[:pos] + rng.choice('0123456789, -[]"1') + line[pos + rng.randint(0, 1) :]
        lines.append(line)
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines) + "\n")
    compare_scans(path, None, [(1, 2**20), (1, 97), (2, 4099)])


def test_the_fast_decoder_accepts_only_what_parse_line_accepts() -> None:
    """The fast path's own verdict, line by line: None (parse_line decides) or exactly
    parse_line's id, token count and spelling of the id, on 40,000 damaged lines."""
    from hsq.dataset.jsonl import parse_line
    from hsq.errors import DatasetError
    from hsq.producer.fastscan import _fast_count

    rng = random.Random(35)
    taken = 0
    for i in range(40_000):
        line = damaged(rng, i)
        for max_tokens in (None, 3):
            got = _fast_count(line, max_tokens)
            if got is None:
                continue
            taken += 1
            try:
                sample = parse_line(line, max_tokens)
            except DatasetError as exc:
                raise AssertionError(f"fast path took {line!r}; parse_line: {exc}") from None
            assert got == (sample.id, len(sample.input_ids), sample.id_text == sample.id), line
    assert taken > 4_000  # not vacuous: thousands of lines survive their edits and go fast


def test_the_fast_scan_agrees_on_randomly_damaged_bytes(tmp_path: Path) -> None:
    rng = random.Random(350)
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b"\n".join(damaged(rng, i) for i in range(3000)) + b"\n")
    compare_scans(path, None, [(1, 2**20), (2, 4099)])


def test_the_fast_scan_skips_over_long_lines_as_the_dataset_scan_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hsq.dataset.jsonl

    monkeypatch.setattr(hsq.dataset.jsonl, "MAX_LINE_BYTES", 60)
    lines = [
        '{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}',  # 59 bytes and "\\n"
        '{"id": "b", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}',  # too long
        "x" * 200,
        "",
        '{"id": "c", "input_ids": [5]}',
        '{"id": "a", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]}',
        '{"id": "d", "input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}',  # no newline
    ]
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(lines))
    compare_scans(path, None)


def write_output(root: Path, sid: str) -> ManifestEntry:
    from bench.scale_outputs import output_bytes

    rel = output_relpath(sid)
    data = output_bytes(sid, "vr", [1, 2, 3, 4])
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)
    return ManifestEntry(rel, 4, len(data), "crc32:0", "w", 0.0, 0)


def test_parallel_verify_finds_what_the_single_process_one_does(
    tmp_path: Path, redis_url: str
) -> None:
    out = tmp_path / "out"
    root = out / "vr"
    st = store(redis_url, "vr")
    st.create_config(RunConfig(run="vr", dataset=str(tmp_path / "d.jsonl"), out=str(out)))
    entries = [(f"v{i:03d}", write_output(root, f"v{i:03d}")) for i in range(60)]
    st.mark_done_many(entries)
    (root / entries[0][1].path).unlink()  # missing
    (root / entries[1][1].path).write_bytes(b"garbage")  # corrupt
    (root / "zz").mkdir()
    (root / "zz" / "stray.safetensors").write_bytes(b"x")  # orphan in no shard
    (root / entries[2][1].path).parent.joinpath(".x.safetensors.h.1.ab.tmp").write_bytes(b"")
    right = (root / entries[3][1].path).parent.name
    wrong = root / ("00" if right != "00" else "01") / f"{entries[3][0]}.safetensors"
    wrong.parent.mkdir(exist_ok=True)
    wrong.write_bytes(b"x")  # a done id, in the wrong shard directory: an orphan
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    st.client.hset(st.keys.done, "v999", json.dumps({"path": "../../x"}))  # refused
    one = verify(st, root, jobs=1)
    two = verify(st, root, jobs=2)
    for res in (one, two):
        assert res.missing == [entries[0][0]] and list(res.corrupt) == [entries[1][0]]
        assert res.ok == 58 and set(res.refused) == {"v999"}
        assert "zz/stray.safetensors" in res.orphans
        assert str(wrong.relative_to(root)) in res.orphans
        assert any(o.endswith(".tmp") for o in res.orphans)
    assert sorted(one.orphans) == sorted(two.orphans)
    assert one.checked == two.checked == 61


def test_verify_judges_symlinked_outputs_by_where_they_lead(tmp_path: Path, redis_url: str) -> None:
    """An output file that is a symlink: one leading out of the output dir is refused (and
    its link an orphan), one leading to a file inside is checked through it, a dangling
    one is missing; in the page pass and the orphan pass, inline and by the pool (verify
    opens files O_NOFOLLOW and only then looks where a link leads)."""
    out = tmp_path / "out"
    root = out / "vr"
    st = store(redis_url, "vr")
    st.create_config(RunConfig(run="vr", dataset=str(tmp_path / "d.jsonl"), out=str(out)))
    entries = [(f"l{i:03d}", write_output(root, f"l{i:03d}")) for i in range(6)]
    st.mark_done_many(entries)
    (outside := tmp_path / "elsewhere").mkdir()
    (root / "keep").mkdir()
    for i, target in ((0, outside), (1, root / "keep")):
        entry = entries[i][1]
        moved = target / f"copy{i}.safetensors"
        (root / entry.path).rename(moved)
        (root / entry.path).symlink_to(moved)  # a valid file, reached through a link
    (root / entries[2][1].path).unlink()
    (root / entries[2][1].path).symlink_to(root / "keep" / "gone.safetensors")  # dangling
    for jobs in (1, 2):
        res = verify(st, root, jobs=jobs)
        assert list(res.refused) == ["l000"] and "resolves outside" in res.refused["l000"]
        assert res.missing == ["l002"] and not res.corrupt and res.ok == 4, res
        assert res.orphans == sorted([entries[0][1].path, "keep/copy1.safetensors"])


def test_the_scale_benchmark_smoke_run(tmp_path: Path) -> None:
    """bench/scale.py at CI size: every step runs and status adds up at each state."""
    argv = [sys.executable, "-m", "bench.scale", "--samples", "3000", "--verify-files", "300"]
    argv += ["--recover-files", "10", "--cap-samples", "1000", "--cap-chunks", "16"]
    argv += ["--cap-procs", "2", "--repeat", "1", "--work", str(tmp_path / "w")]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"step"')]
    res: dict[str, Any] = {r["step"]: r for r in rows}
    for step in ("status_all_queued", "status_mid_run", "status_recount", "status_after_requeue"):
        st = res[step]
        parts = ("done", "queued", "in_progress", "retry", "dead", "missing")
        assert sum(st[k] for k in parts) == st["total"] == 3000, st
    keys = ("total", *parts)
    assert [res["status_mid_run"][k] for k in keys] == [res["status_recount"][k] for k in keys]
    assert f"requeued {res['status_mid_run']['dead']}" in res["requeue_failed"]["output"]
    assert "ok 300," in res["verify_headers"]["output"]
    assert "recovered       10 " in res["recover"]["output"]
    assert res["reenqueue"]["output"].endswith("enqueued        0 samples in 0 jobs")
    assert {r["batch"] for r in res["capacity"]["rows"]} == {"per-sample", 16}
    assert not (tmp_path / "w").exists()


def test_done_entries_are_stored_compactly_and_read_back_as_the_manifest_json(
    tmp_path: Path, redis_url: str
) -> None:
    st = new_run(redis_url, "cmp", tmp_path, 4)
    e = ManifestEntry(output_relpath("s0000"), 300, 1234, "crc32:89abcdef", "h.1a2b3c", 5.25, 1)
    odd = ManifestEntry("00/elsewhere.safetensors", 3, 100, "sha:1", "w", 0.0, 0, "fp8-e4m3")
    st.mark_done_many([("s0000", e), ("s0001", odd)])
    raw = st.client.hget(st.keys.done, "s0000")
    assert raw is not None and len(raw) < len(e.to_json()) // 2
    assert st.get_manifest("s0000") == ManifestEntry(
        e.path, 300, 1234, "crc32:89abcdef", "h.1a2b3c", 5.2, 1
    )
    assert st.get_manifest("s0001") == odd  # not the usual shape: kept as JSON
    assert dict(st.iter_manifest())["s0000"] == st.get_manifest("s0000")
    assert json.loads(st.ledger.done_entries(["s0000"])[0] or b"")["path"] == e.path
    st.client.hset(st.keys.done, "s0002", "m1|x|y")  # damaged: handed back as it is
    assert st.get_manifest("s0002") is None
    assert dict(st.ledger.iter_done())["s0002"] == b"m1|x|y"


def test_verify_reads_the_stored_form_with_the_verdicts_of_its_json(tmp_path: Path) -> None:
    """verify checks the done hash's compact form without turning it into JSON first; for
    every stored value, valid or damaged, trusted_entry gives what it gives on the JSON."""
    from hsq.ops import trusted_entry
    from hsq.outputs.manifest import encode_manifest, manifest_json

    out = tmp_path / "out"
    (out / output_relpath("s1")).parent.mkdir(parents=True)
    good = encode_manifest(
        "s1", ManifestEntry(output_relpath("s1"), 3, 100, "crc32:1", "w", 0.5, 2)
    )
    rng = random.Random(7)
    stored = [good, "m1|3|100|1|w|0.5|2|fp8-e4m3", "m1|x|y", "m1|3|100|1|w|nan|2|", good + "|"]
    stored += ["m1|3|100|1|" + "\x01" * 20000 + "|0.5|2|", '{"path": 1}', "m1|3|1_0|1|w|1e300|+2|"]
    for _ in range(3000):
        b = list(good)
        b[rng.randrange(len(b))] = rng.choice("|:0123456789.-x\x00\xe9")
        stored.append("".join(b))
    for sid in ("s1", "../s1"):
        for raw in stored:
            outcomes: list[ManifestEntry | str] = []
            for form in (raw.encode(), manifest_json(sid, raw.encode())):
                try:
                    outcomes.append(trusted_entry(sid, form, out))
                except ValueError as exc:
                    outcomes.append(str(exc))
            assert outcomes[0] == outcomes[1] or "nan" in raw, (sid, raw, outcomes)
