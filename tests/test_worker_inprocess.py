"""The whole worker in-process against fakes: an httpx.MockTransport server that writes
real dumps into a temp dump dir, and a fake store with run generations. Unit tests of the
worker's logic (a dataset gone for a moment, bad headers, a bad first dump, mixed dtypes,
run changes); tests/test_inflight.py runs the
real processes."""

from __future__ import annotations

import errno
import itertools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import torch

from hsq.dataset.jsonl import IndexEntry, scan_dataset
from hsq.dataset.read import read_sample
from hsq.dump.find import scan_by_rid
from hsq.dump.format import TENSOR_FILE, DumpMeta, ModelIdentity, expected_shapes, fingerprint
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.dump.write import write_dump
from hsq.outputs.manifest import ManifestEntry
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.states import AUX_TENSOR, LAST_TENSOR
from hsq.store import ChunkJob, MemoryRun, MemoryStore, SampleRef
from hsq.workers.lock import DumpDirLock
from hsq.workers.runview import RunView
from hsq.workers.send.client import ServerClient
from hsq.workers.startup import STAGING, Started
from hsq.workers.worker import Worker
from tests.helpers import worker_settings

IDENT = ModelIdentity("unit", "LlamaModel", 8, 16, "0" * 64)
EVIL = ModelIdentity("other", "LlamaModel", 8, 16, "1" * 64)
LAYERS = [2, 4, 5]


class FakeStore(MemoryStore[ManifestEntry]):
    """The shipped in-memory store as the worker's, counting the calls these tests look at;
    `recreate` purges and re-creates the run through an operator's store of its own, so the
    worker's writes are refused (RunChangedError) until it re-reads the config."""

    def __init__(self, cfg: RunConfig | None, jobs: list[ChunkJob]) -> None:
        super().__init__(MemoryRun("r"))
        self.operator: MemoryStore[ManifestEntry] = MemoryStore(self.state)
        self.calls: Counter[str] = Counter()
        self.on_mark: Callable[[str], None] | None = None
        self.on_give_back: Callable[[], None] | None = None
        self.recreate(cfg, jobs)

    def recreate(self, cfg: RunConfig | None, jobs: list[ChunkJob]) -> None:
        self.operator.purge()
        for key in [k for k in self.calls if k.startswith("mark:")]:
            del self.calls[key]
        if cfg is not None:
            self.operator.create_config(cfg)
            self.operator.enqueue([job.samples for job in jobs])

    def mark_done_many(self, entries: Sequence[tuple[str, ManifestEntry]]) -> list[bool]:
        out = []
        for sid, entry in entries:  # one at a time: a hook may purge the run mid-batch
            if self.on_mark is not None:
                self.on_mark(sid)
            out += super().mark_done_many([(sid, entry)])
            self.calls[f"mark:{sid}"] += 1
        return out

    def finish(self, worker_id: str, job: ChunkJob) -> bool:
        ours = super().finish(worker_id, job)
        self.calls["finish"] += 1
        return ours

    def give_back(self, worker_id: str, job: ChunkJob) -> bool:
        back = super().give_back(worker_id, job)
        self.calls["give_back"] += 1
        if back and self.on_give_back is not None:
            self.on_give_back()
        return back


Behaviour = Callable[[int, list[int]], dict[str, Any]]
"""(call number, input ids) -> overrides: status, model, dtype, nan, header, hidden."""


class FakeServer:
    """/generate writes one real dump per request (write_dump), as the servers do."""

    def __init__(self, dump_dir: Path, behave: Behaviour | None = None) -> None:
        self.dump_dir = dump_dir
        self.behave = behave or (lambda _n, _ids: {})
        self._calls = itertools.count()
        self._index = itertools.count()
        self._lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        ids, rid = body["input_ids"], body["rid"]
        with self._lock:
            call = next(self._calls)
        b = self.behave(call, ids)
        if "status" in b:
            return httpx.Response(b["status"], text="injected")
        self._dump(ids, rid, b)
        return httpx.Response(200, json={"meta_info": {"prompt_tokens": len(ids)}})

    def _dump(self, ids: list[int], rid: str, b: dict[str, Any]) -> None:
        n, hidden = len(ids), b.get("hidden", 16)
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[b.get("dtype", "bfloat16")]
        gen = torch.Generator().manual_seed(sum(ids))
        tensors = {
            AUX_TENSOR: torch.randn(n, len(LAYERS) * hidden, generator=gen).to(dtype),
            LAST_TENSOR: torch.randn(n, hidden, generator=gen).to(dtype),
        }
        if b.get("nan"):
            tensors[AUX_TENSOR][0, 0] = float("nan")
        meta = DumpMeta(
            rid=rid,
            num_tokens=n,
            input_fingerprint=fingerprint(ids),
            layer_ids=LAYERS,
            hidden_size=hidden,
            dtype=b.get("dtype", "bfloat16"),
            model=b.get("model", IDENT),
            tensors=expected_shapes(n, len(LAYERS), hidden),
            request_index=0,
        )
        header = b.get("header")
        before = None
        if header is not None:

            def before(tmp: Path) -> None:
                raw = json.dumps(header).encode()
                (tmp / TENSOR_FILE).write_bytes(len(raw).to_bytes(8, "little") + raw)

        with self._lock:
            index = next(self._index)
        write_dump(self.dump_dir, index, meta, tensors, fsync=False, before_done=before)


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, list[SampleRef]]:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 12, seed=4, min_len=4, max_len=24)
    refs: list[SampleRef] = []
    for line in scan_dataset(ds):
        assert line.entry is not None and line.sample_id is not None
        refs.append((line.sample_id, line.entry))
    return ds, refs


def jobs_of(refs: list[SampleRef], size: int = 3) -> list[ChunkJob]:
    return [
        ChunkJob(f"j{i}", "main", refs[i : i + size], 0, None) for i in range(0, len(refs), size)
    ]


def config(ds: Path, out: Path, **kw: Any) -> RunConfig:
    return RunConfig(run="r", dataset=str(ds), out=str(out), **kw)


def run_worker(
    tmp_path: Path,
    store: FakeStore,
    server: FakeServer | None = None,
    stop_when_done: list[SampleRef] | None = None,
    **kw: Any,
) -> Worker:
    dump = tmp_path / "dumps"
    dump.mkdir(exist_ok=True)
    server = server or FakeServer(dump)
    server.dump_dir = dump
    # The fake server's dump hook is "active": it announces itself as real servers do.
    marker = ReadyMarker(tuple(LAYERS), IDENT, "fake", "0", "0", os.getpid(), time.time())
    write_ready(dump, marker, fsync=False)
    opts: dict[str, Any] = {
        "burst": True,
        "dump_timeout_s": 2.0,
        "backoff_max_s": 0.05,
        "inflight": 4,
        "heartbeat_interval_s": 0.5,
    }
    opts.update(kw)
    opts.setdefault("persist_procs", 0)  # threads: the stages monkeypatched here run here
    settings = worker_settings(
        run="r", server="http://srv", dump_dir=dump, redis_url="redis://unused", **opts
    )
    staging = dump / STAGING
    staging.mkdir(exist_ok=True)
    lock = DumpDirLock(dump)
    lock.acquire("w")
    view = RunView.of(store.require_config(), "r")
    client = ServerClient("http://srv", transport=httpx.MockTransport(server))
    worker = Worker(settings, Started(store, view, lock, staging, 0), client, "w.1")
    t = threading.Thread(target=worker.run)
    t.start()
    if stop_when_done is not None:  # a long-running (not --burst) worker
        deadline = time.monotonic() + 60
        while set(store.done) != ids_of(stop_when_done) and time.monotonic() < deadline:
            time.sleep(0.02)
        worker.request_stop()
    t.join(60)
    assert not t.is_alive(), "worker did not finish"
    return worker


def ids_of(refs: list[SampleRef]) -> set[str]:
    return {sid for sid, _ in refs}


def every_sample_marked_once(store: FakeStore, refs: list[SampleRef]) -> None:
    assert set(store.done) == ids_of(refs)
    assert all(store.calls[f"mark:{sid}"] == 1 for sid in store.done)
    assert not store.dead and not store.held


@pytest.mark.parametrize("inflight", [1, 4])
def test_all_samples_done_once_with_k_in_flight(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]], inflight: int
) -> None:
    ds, refs = dataset
    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    run_worker(tmp_path, store, inflight=inflight)
    every_sample_marked_once(store, refs)
    assert store.calls["finish"] == len(jobs_of(refs))
    files = list((tmp_path / "out" / "r").rglob("*.safetensors"))
    assert len(files) == len(refs)
    assert (
        store.cfg is not None and store.cfg.dump_dtype == "bfloat16" and store.cfg.hidden_size == 16
    )


def test_unreadable_dataset_is_handed_back_never_dead(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    """A dataset moved away for a second sent 95% of a run to the dead letter."""
    ds, refs = dataset
    store = FakeStore(config(ds, tmp_path / "out", max_attempts=1), jobs_of(refs))
    away = ds.with_suffix(".away")
    ds.rename(away)

    def bring_back() -> None:
        if away.exists():
            away.rename(ds)

    store.on_give_back = bring_back
    run_worker(tmp_path, store)
    assert store.calls["give_back"] >= 1
    every_sample_marked_once(store, refs)


def test_eio_reading_the_dataset_is_handed_back_never_dead(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ds, refs = dataset
    failures = iter(range(3))

    def flaky(path: Path, sid: str, entry: IndexEntry) -> Any:
        if next(failures, None) is not None:
            raise OSError(errno.EIO, "Input/output error")
        return read_sample(path, sid, entry)

    monkeypatch.setattr("hsq.workers.send.extract.read_sample", flaky)
    store = FakeStore(config(ds, tmp_path / "out", max_attempts=1), jobs_of(refs))
    run_worker(tmp_path, store)
    every_sample_marked_once(store, refs)


def test_server_5xx_is_retried_without_using_attempts(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    ds, refs = dataset
    server = FakeServer(tmp_path, lambda call, _ids: {"status": 500} if call < 2 else {})
    store = FakeStore(config(ds, tmp_path / "out", max_attempts=1), jobs_of(refs))
    run_worker(tmp_path, store, server, inflight=1)
    every_sample_marked_once(store, refs)


def test_a_poison_5xx_sample_ends_dead_after_the_crash_budget(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    ds, refs = dataset
    poison = fingerprint(read_sample(ds, refs[0][0], refs[0][1]).input_ids)
    server = FakeServer(
        tmp_path, lambda _c, ids: {"status": 500} if fingerprint(ids) == poison else {}
    )
    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    run_worker(tmp_path, store, server)
    assert store.dead[refs[0][0]]["reason"] == "server_error"
    assert set(store.done) == ids_of(refs[1:])


def test_a_malformed_tensor_header_ends_dead_never_silently_dropped(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    """Header entries that are not objects crashed the persist handler, the
    chunk finished anyway and the sample was in no queue and not dead."""
    ds, refs = dataset
    bad = fingerprint(read_sample(ds, refs[2][0], refs[2][1]).input_ids)
    header = {AUX_TENSOR: 5, LAST_TENSOR: "x"}
    server = FakeServer(
        tmp_path, lambda _c, ids: {"header": header} if fingerprint(ids) == bad else {}
    )
    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    run_worker(tmp_path, store, server)
    assert store.dead[refs[2][0]]["reason"] == "corrupt_dump"
    assert store.dead[refs[2][0]]["attempts"] == 3
    assert set(store.done) | set(store.dead) == ids_of(refs) and not store.held


def test_an_unexpected_exception_in_a_stage_is_retried_not_dropped(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ds, refs = dataset
    import hsq.workers.persist.stage
    from hsq.workers.persist.work import write_staged as real  # the name persist calls

    boom = iter([True])

    def flaky(*a: Any, **kw: Any) -> Any:
        if next(boom, False):
            raise KeyError("surprise")
        return real(*a, **kw)

    monkeypatch.setattr(hsq.workers.persist.stage, "write_staged", flaky)
    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    with structlog.testing.capture_logs() as logs:
        run_worker(tmp_path, store)
    every_sample_marked_once(store, refs)
    assert [e["reason"] for e in logs if e["event"] == "sample_retry"] == ["internal_error"]


def test_a_matcher_bug_stops_the_worker_and_hands_every_sample_back(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception from the dump matcher was logged and the worker went on
    polling: every request in flight timed out as no_dump and ended in the dead letter, a
    bug of the worker's charged to the samples. Now the worker hands its work back and
    stops with InternalError: nothing dead, nothing retried, nothing lost."""
    from hsq.workers.send.ridmatch import RidMatcher  # the class the dispatcher polls with

    ds, refs = dataset
    real = RidMatcher.poll
    decided = [0]

    def buggy(self: RidMatcher, now: float) -> Any:
        if decided[0] >= 3 and self.wanted:  # a few samples done, then requests in flight
            raise KeyError("a bug in the matcher")
        found = real(self, now)
        decided[0] += len(found[0])
        return found

    monkeypatch.setattr(RidMatcher, "poll", buggy)
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: raised.append(a.exc_value))
    store = FakeStore(config(ds, tmp_path / "out", max_attempts=1), jobs_of(refs))
    with structlog.testing.capture_logs() as logs:
        run_worker(tmp_path, store)
    from hsq.errors import InternalError

    assert [type(e) for e in raised] == [InternalError]
    assert not store.dead and not store.held
    queued = {sid for job in [*store.state.main, *store.state.retry] for sid, _ in job.samples}
    assert queued and set(store.done) | queued == ids_of(refs)
    events = [e["event"] for e in logs]
    assert "sample_retry" not in events and "sample_dead" not in events
    assert "dump_matcher_failed" in events and "internal_error_stopping" in events


def test_a_first_dump_that_fails_validation_pins_nothing(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    """A bad first dump pinned its model and every later sample failed."""
    ds, refs = dataset
    server = FakeServer(tmp_path, lambda c, _ids: {"model": EVIL, "nan": True} if c == 0 else {})
    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    run_worker(tmp_path, store, server, inflight=1)
    every_sample_marked_once(store, refs)
    assert store.cfg is not None and store.cfg.model_id == IDENT.model_id


def test_dtype_and_hidden_size_are_pinned_and_checked(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    """One run ended with BF16 and F32 files side by side."""
    ds, refs = dataset
    f32 = fingerprint(read_sample(ds, refs[5][0], refs[5][1]).input_ids)
    server = FakeServer(
        tmp_path, lambda _c, ids: {"dtype": "float32"} if fingerprint(ids) == f32 else {}
    )
    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    run_worker(tmp_path, store, server, inflight=1)
    assert store.dead[refs[5][0]]["reason"] == "meta_mismatch"
    assert "dtype" in store.dead[refs[5][0]]["message"]
    assert set(store.done) == ids_of(refs) - {refs[5][0]}
    assert store.cfg is not None and store.cfg.dump_dtype == "bfloat16"


def test_hidden_size_pinned_in_the_run_is_enforced(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    ds, refs = dataset
    store = FakeStore(config(ds, tmp_path / "out", hidden_size=32), jobs_of(refs[:3]))
    run_worker(tmp_path, store)
    assert {v["reason"] for v in store.dead.values()} == {"meta_mismatch"}
    assert not store.done


def test_run_changed_drops_in_flight_work_and_continues_with_the_new_config(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    """Purge and re-create under a running worker (its side of the fence)."""
    ds, refs = dataset
    store = FakeStore(config(ds, tmp_path / "old"), jobs_of(refs))
    new_cfg = config(ds, tmp_path / "new")
    marks = iter(range(100))

    def on_mark(_sid: str) -> None:
        if next(marks) == 3:  # after 3 samples: the run is purged and re-created
            store.recreate(None, [])
            threading.Timer(0.3, lambda: store.recreate(new_cfg, jobs_of(refs))).start()

    store.on_mark = on_mark
    with structlog.testing.capture_logs() as logs:
        w = run_worker(tmp_path, store)
    events = [e["event"] for e in logs]
    assert "run_changed" in events and "run_gone_waiting" in events
    assert "run_config_reloaded" in events
    assert w.view.out_root == tmp_path / "new" / "r"
    every_sample_marked_once(store, refs)
    assert len(list((tmp_path / "new" / "r").rglob("*.safetensors"))) == len(refs)


def test_protocol_scan_reads_each_dump_once(tmp_path: Path) -> None:
    # The scan is the hot loop of the dispatcher: it must not read tensors.
    d = tmp_path / "d"
    d.mkdir()
    FakeServer(d)._dump([1, 2, 3], "r", {})
    s = scan_by_rid(d)
    assert list(s.complete) == ["r"] and s.writing == 0


def test_an_idle_worker_notices_a_wiped_run_and_picks_up_the_new_one(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    """After a Redis wipe and re-create with another --out, workers kept
    writing into the old directory (and an idle one said nothing)."""
    ds, refs = dataset
    store = FakeStore(config(ds, tmp_path / "old"), [])
    new_cfg = config(ds, tmp_path / "new", created=1.0)

    def wipe_then_recreate() -> None:
        store.recreate(None, [])
        time.sleep(0.5)
        store.recreate(new_cfg, jobs_of(refs))

    threading.Timer(0.3, wipe_then_recreate).start()
    with structlog.testing.capture_logs() as logs:
        w = run_worker(tmp_path, store, burst=False, reap_interval_s=0.1, stop_when_done=refs)
    events = [e["event"] for e in logs]
    assert "run_gone_waiting" in events and "run_config_reloaded" in events
    assert w.view.out_root == tmp_path / "new" / "r"
    every_sample_marked_once(store, refs)


def test_k_requests_are_in_flight_at_once(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    ds, refs = dataset
    barrier = threading.Barrier(4, timeout=20)  # breaks unless 4 requests wait together

    def together(call: int, _ids: list[int]) -> dict[str, Any]:
        if call < 4:
            barrier.wait()
        return {}

    store = FakeStore(config(ds, tmp_path / "out", max_attempts=1), jobs_of(refs))
    run_worker(tmp_path, store, FakeServer(tmp_path, together), inflight=4)
    every_sample_marked_once(store, refs)


def test_max_inflight_tokens_bounds_the_tokens_on_the_server(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    ds, refs = dataset
    lock = threading.Lock()
    now, peak = [0], [0]

    class Counting(FakeServer):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path != "/generate":
                return super().__call__(request)
            n = len(json.loads(request.content)["input_ids"])
            with lock:
                now[0] += n
                peak[0] = max(peak[0], now[0])
            try:
                time.sleep(0.01)
                return super().__call__(request)
            finally:
                with lock:
                    now[0] -= n

    budget = 30
    longest = max(e.num_tokens for _, e in refs)
    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    w = run_worker(tmp_path, store, Counting(tmp_path), inflight=8, max_inflight_tokens=budget)
    every_sample_marked_once(store, refs)
    assert peak[0] <= max(budget, longest)
    assert w.inflight.peak_tokens <= max(budget, longest)


def test_a_chunk_handed_back_does_not_bring_back_its_retried_samples(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    """A sample already in a retry job (or dead) is not redone from its handed-back chunk:
    it would be written twice, or end both dead and done."""
    ds, refs = dataset
    calls: Counter[str] = Counter()

    def behave(call: int, ids: list[int]) -> dict[str, Any]:
        calls[fingerprint(ids)] += 1
        if call == 0:
            return {"nan": True}  # sample 0: non_finite, retried as a job of its own
        if call == 1:
            return {"status": 503}  # sample 1: server not ready, the chunk goes back
        return {}

    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    run_worker(tmp_path, store, FakeServer(tmp_path, behave), inflight=1)
    every_sample_marked_once(store, refs)
    first = fingerprint(read_sample(ds, refs[0][0], refs[0][1]).input_ids)
    assert calls[first] == 2  # the bad attempt and its retry, not a third from the chunk


def test_the_server_gets_k_new_requests_while_k_answered_wait_for_their_dumps(
    tmp_path: Path, dataset: tuple[Path, list[SampleRef]]
) -> None:
    """A request's slot on the server is freed by its answer, not by its dump being
    matched and handed on (BENCHMARKS.md 8d: holding it left SGLang below K). The first K
    answers come with their dumps held back; the next K requests must all reach the
    server at once (a barrier of K) before any of those dumps is written."""
    ds, refs = dataset
    k = 4
    barrier = threading.Barrier(k, timeout=20)
    release = threading.Event()
    met: list[bool] = []

    class Holding(FakeServer):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path != "/generate":
                return super().__call__(request)
            body = json.loads(request.content)
            with self._lock:
                call = next(self._calls)
            ids, rid = body["input_ids"], body["rid"]
            if call < k:  # answered now, its dump written only once the next K came

                def later() -> None:
                    release.wait()
                    self._dump(ids, rid, {})

                threading.Thread(target=later, daemon=True).start()
            else:
                if call < 2 * k:
                    try:
                        barrier.wait()
                        met.append(True)
                    except threading.BrokenBarrierError:
                        met.append(False)
                    release.set()
                self._dump(ids, rid, {})
            return httpx.Response(200, json={"meta_info": {"prompt_tokens": len(ids)}})

    store = FakeStore(config(ds, tmp_path / "out"), jobs_of(refs))
    w = run_worker(tmp_path, store, Holding(tmp_path), inflight=k, dump_timeout_s=60.0)
    every_sample_marked_once(store, refs)
    assert met == [True] * k
    assert w.inflight.total == 0
