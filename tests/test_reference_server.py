"""The reference server as a real subprocess over real HTTP: API, dumps, faults."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hsq import errors
from hsq.dump.find import clear_dump_dir, scan, wait_for_dump
from hsq.dump.format import TMP_SUFFIX
from hsq.dump.read import read_dump, read_meta
from hsq.engines.reference.engine import CRASH_EXIT_CODE
from hsq.engines.reference.model import load_model
from hsq.engines.reference.tolerance import closeness
from hsq.node.spawn import FRESH
from tests.conftest import expected_for, generate
from tests.helpers import wait_until
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
IDS = [5, 17, 300, 4000, 12, 9, 31999, 0, 77, 1024, 2048, 3]


@pytest.fixture(scope="module")
def server(server_factory: Factory) -> ReferenceServer:
    # The counter starts at 5 and 3 warm-ups take 5, 6, 7: the first real dump is req_8.
    srv = server_factory("--counter-start", "5", "--warmup", "3", "--max-tokens", "256")
    return srv.wait_ready()


@pytest.fixture
def clean(server: ReferenceServer) -> ReferenceServer:
    clear_dump_dir(server.dump_dir)
    httpx.delete(server.url + "/admin/faults").raise_for_status()
    return server


def set_faults(srv: ReferenceServer, *rules: dict[str, Any]) -> None:
    httpx.post(srv.url + "/admin/faults", json={"rules": list(rules)}).raise_for_status()


def test_warmups_move_the_counter_and_leave_dumps(server: ReferenceServer) -> None:
    info = httpx.get(server.url + "/server_info").json()
    assert info["request_counter"] >= 8
    warm = [p for p in scan(server.dump_dir).complete if p.name in ("req_5", "req_6", "req_7")]
    if info["request_counter"] == 8:  # nothing else ran yet in this module
        assert [p.name for p in warm] == ["req_5", "req_6", "req_7"]


def test_health_and_model_info(server: ReferenceServer) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    info = httpx.get(server.url + "/model_info").json()
    assert info["is_generation"] is True
    assert info["hsq"]["layer_ids"] == [2, 4, 5]  # EAGLE-3 rule for L=8
    assert info["hsq"]["hidden_size"] == 64


def test_generate_dumps_the_same_states_as_a_direct_forward(clean: ReferenceServer) -> None:
    r = generate(clean.url, IDS, "rid-direct")
    assert r.status_code == 200
    meta_info = r.json()["meta_info"]
    assert meta_info["prompt_tokens"] == len(IDS) and meta_info["cached_tokens"] == 0
    assert meta_info["id"] == "rid-direct"
    path = wait_for_dump(clean.dump_dir, timeout=10)
    dump = read_dump(
        path, expected_for(IDS, "rid-direct", layer_ids=[2, 4, 5], hidden_size=64, dtype="bfloat16")
    )
    torch.set_num_threads(2)
    model = load_model(
        "tiny", device="cpu", dtype=torch.float32, dump_dtype=torch.bfloat16, layers=None
    )
    direct = model.forward(IDS)
    assert dump.meta.model.model_id == model.identity.model_id
    assert torch.equal(dump.aux_hidden_states, direct.aux)
    assert torch.equal(dump.last_hidden_state, direct.last)


def test_counter_persists_across_requests(clean: ReferenceServer) -> None:
    indices = []
    for i in range(3):
        assert generate(clean.url, IDS[: 4 + i], f"c{i}").status_code == 200
        path = wait_for_dump(clean.dump_dir, timeout=10)
        indices.append(read_dump(path, expected_for(IDS[: 4 + i], f"c{i}")).meta.request_index)
        clear_dump_dir(clean.dump_dir)
    assert indices == [indices[0], indices[0] + 1, indices[0] + 2]
    assert indices[0] >= 8


@pytest.mark.parametrize(
    "body,message",
    [
        (b"{bad json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"text": "hello"}', "input_ids is required"),
        (b'{"input_ids": []}', "non-empty"),
        (b'{"input_ids": [1, "2"]}', "integers only"),
        (b'{"input_ids": [1, 2.5]}', "integers only"),
        (b'{"input_ids": [1, true]}', "integers only"),
        (b'{"input_ids": [1, -4]}', "within"),
        (b'{"input_ids": [1, 32000]}', "within"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 8}}', "prefill"),
        (b'{"input_ids": [1], "rid": 5}', "rid"),
    ],
)
def test_bad_requests_get_400_and_the_server_stays_up(
    clean: ReferenceServer, body: bytes, message: str
) -> None:
    r = httpx.post(clean.url + "/generate", content=body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    assert httpx.get(clean.url + "/health").status_code == 200
    assert scan(clean.dump_dir).complete == []


def test_too_long_input_is_rejected(clean: ReferenceServer) -> None:
    r = generate(clean.url, [1] * 257, "long")
    assert r.status_code == 400 and "--max-tokens" in r.json()["error"]["message"]
    assert generate(clean.url, [1] * 256, "ok").status_code == 200


def test_unknown_route_is_404(clean: ReferenceServer) -> None:
    assert httpx.get(clean.url + "/nope").status_code == 404


def test_bad_fault_rule_is_400(clean: ReferenceServer) -> None:
    r = httpx.post(clean.url + "/admin/faults", json={"rules": [{"mode": "explode"}]})
    assert r.status_code == 400 and "unknown fault mode" in r.text


# --------------------------------------------------------------------------- faults


def settled(dump_dir: Path, dumps: int, timeout: float = 30.0) -> None:
    """Wait for the event "the server wrote `dumps` dumps and writes nothing more": the
    writer renames each dump into place, parts one after another, after its answer."""

    def state() -> tuple[int, int]:
        s = scan(dump_dir)  # protocol names only (the readiness marker stays out)
        writing = sum(p.name.endswith(TMP_SUFFIX) for p in s.pending)
        return len(s.complete) + len(s.pending) - writing, writing

    wait_until(lambda: state() == (dumps, 0), timeout, interval=0.01)


# The dumps each fault leaves for one request.
FAULT_DUMPS = {"split": 2}


def _fault_dump_error(srv: ReferenceServer, mode: str) -> errors.DumpError:
    set_faults(srv, {"mode": mode, "times": 1})
    ids = IDS[:10]
    assert generate(srv.url, ids, f"f-{mode}").status_code == 200
    # Look only once the writer is finished: the first half of a split alone on disk reads
    # as a short dump, and a dump still being written as no dump at all.
    settled(srv.dump_dir, FAULT_DUMPS.get(mode, 1))
    with pytest.raises(errors.DumpError) as info:
        # Only no_done waits out the timeout (its dump never gets the marker).
        path = wait_for_dump(srv.dump_dir, timeout=1.0)
        read_dump(path, expected_for(ids, f"f-{mode}"))
    return info.value


@pytest.mark.parametrize(
    "mode,error",
    [
        ("stale", errors.StaleDumpError),
        ("split", errors.MultipleDumpsError),
        ("no_done", errors.IncompleteDumpError),
        ("wrong_count", errors.WrongLengthError),
        ("nan", errors.NonFiniteDumpError),
        ("corrupt", errors.CorruptDumpError),
    ],
)
def test_fault_produces_the_dump_it_claims(
    clean: ReferenceServer, mode: str, error: type[errors.DumpError]
) -> None:
    assert type(_fault_dump_error(clean, mode)) is error
    # `times=1`: the next request is healthy again.
    clear_dump_dir(clean.dump_dir)
    assert generate(clean.url, IDS, "after").status_code == 200
    read_dump(wait_for_dump(clean.dump_dir, timeout=10), expected_for(IDS, "after"))


def test_split_writes_two_halves(clean: ReferenceServer) -> None:
    set_faults(clean, {"mode": "split", "times": 1})
    assert generate(clean.url, IDS, "s").status_code == 200
    settled(clean.dump_dir, 2)
    parts = scan(clean.dump_dir).complete
    assert len(parts) == 2
    metas = [read_meta(p) for p in parts]
    assert [m.num_tokens for m in metas] == [len(IDS) // 2, len(IDS) - len(IDS) // 2]
    assert {m.rid for m in metas} == {"s"}


def test_fault_bound_to_one_input_fingerprint(clean: ReferenceServer) -> None:
    from hsq.dump.format import fingerprint

    set_faults(clean, {"mode": "wrong_count", "fingerprint": fingerprint(IDS)})
    other = IDS[:5]
    assert generate(clean.url, other, "o").status_code == 200
    read_dump(wait_for_dump(clean.dump_dir, timeout=10), expected_for(other, "o"))
    clear_dump_dir(clean.dump_dir)
    for attempt in range(2):  # permanent: every attempt of that sample is wrong
        assert generate(clean.url, IDS, f"p{attempt}").status_code == 200
        with pytest.raises(errors.WrongLengthError):
            read_dump(wait_for_dump(clean.dump_dir, timeout=10), expected_for(IDS, f"p{attempt}"))
        clear_dump_dir(clean.dump_dir)


def test_slow_fault_delays_the_answer(clean: ReferenceServer) -> None:
    set_faults(clean, {"mode": "slow", "seconds": 0.6, "times": 1})
    t0 = time.monotonic()
    assert generate(clean.url, IDS, "slow").status_code == 200
    assert time.monotonic() - t0 >= 0.6
    read_dump(wait_for_dump(clean.dump_dir, timeout=10), expected_for(IDS, "slow"))


def test_http_500_fault_answers_500_without_a_dump(clean: ReferenceServer) -> None:
    set_faults(clean, {"mode": "http_500", "times": 1})
    assert generate(clean.url, IDS, "e").status_code == 500
    with pytest.raises(errors.NoDumpError):
        wait_for_dump(clean.dump_dir, timeout=0.3)


def test_crash_fault_kills_the_process_mid_request(server_factory: Factory) -> None:
    srv = server_factory("--fault", "crash:times=1", name="crash").wait_ready()
    with pytest.raises(httpx.HTTPError):
        generate(srv.url, IDS, "boom")
    assert srv.proc.wait(10) == CRASH_EXIT_CODE
    with pytest.raises(errors.IncompleteDumpError):
        wait_for_dump(srv.dump_dir, timeout=0.2)
    assert [p.name for p in scan(srv.dump_dir).pending] == ["req_0.tmp"]


@pytest.mark.parametrize("start", ["zygote", "fresh"])
def test_two_processes_give_bit_identical_states(
    server: ReferenceServer, server_factory: Factory, start: str
) -> None:
    """`server` as the session starts servers (a fork of the zygote unless
    HSQ_TEST_SPAWNER=fresh), the twin forked from it too or exec'd fresh."""
    spawner = FRESH if start == "fresh" else None
    other = server_factory("--warmup", "1", name="twin", spawner=spawner).wait_ready()
    assert other.spawned_by == ("fresh" if start == "fresh" else server.spawned_by)
    dumps = []
    for srv in (server, other):
        clear_dump_dir(srv.dump_dir)
        httpx.delete(srv.url + "/admin/faults").raise_for_status()
        assert generate(srv.url, IDS, "twin").status_code == 200
        dumps.append(read_dump(wait_for_dump(srv.dump_dir, timeout=10), expected_for(IDS, "twin")))
    a, b = dumps
    assert a.meta.request_index != b.meta.request_index  # different counters, same states
    assert torch.equal(a.aux_hidden_states, b.aux_hidden_states)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)


@pytest.mark.realproc
def test_sigterm_stops_the_server_cleanly(server_factory: Factory) -> None:
    # A fresh exec: the signal handling as `hsq serve-reference` sets it up from nothing.
    srv = server_factory(name="term", spawner=FRESH).wait_ready()
    assert srv.spawned_by == "fresh"
    assert generate(srv.url, IDS, "t").status_code == 200
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(15) == 0
    read_dump(wait_for_dump(srv.dump_dir, timeout=1), expected_for(IDS, "t"))


# --------------------------------------------------------------------------- batching


def _post_concurrently(
    srv: ReferenceServer, requests: list[tuple[str, list[int]]]
) -> list[httpx.Response]:
    """Pause the engine, queue every request on its own connection, then resume: the
    queued requests form batches deterministically (no timing involved)."""
    httpx.post(srv.url + "/admin/pause").raise_for_status()
    with ThreadPoolExecutor(len(requests)) as pool:
        try:
            futures = []
            for i, (rid, ids) in enumerate(requests):  # queued in this order (FIFO batches)
                futures.append(pool.submit(generate, srv.url, ids, rid))
                _wait_pending(srv, i + 1)
        finally:
            httpx.post(srv.url + "/admin/resume").raise_for_status()
        return [f.result() for f in futures]


def _wait_pending(srv: ReferenceServer, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(srv.url + "/server_info").json()["pending_requests"] < n:
        assert time.monotonic() < deadline, f"{n} requests never queued"
        time.sleep(0.02)


def _dumps_by_rid(srv: ReferenceServer, n: int) -> dict[str, Path]:
    deadline = time.monotonic() + 30
    while len(found := scan(srv.dump_dir).complete) < n:
        assert time.monotonic() < deadline, f"only {len(found)} of {n} dumps"
        time.sleep(0.02)
    return {read_meta(p).rid: p for p in found}


def _batches(srv: ReferenceServer) -> int:
    return int(httpx.get(srv.url + "/server_info").json()["batches_run"])


@pytest.fixture(scope="module")
def batching(server_factory: Factory) -> ReferenceServer:
    srv = server_factory("--max-batch-requests", "8", "--max-batch-tokens", "8192", name="batch")
    return srv.wait_ready()


@pytest.fixture(scope="module")
def single_model() -> Any:
    torch.set_num_threads(2)
    return load_model(
        "tiny", device="cpu", dtype=torch.float32, dump_dtype=torch.bfloat16, layers=None
    )


def _lengths_requests(lengths: list[int], tag: str) -> list[tuple[str, list[int]]]:
    gen = torch.Generator().manual_seed(sum(lengths))
    return [
        (f"{tag}{i}", torch.randint(0, 32000, (n,), generator=gen).tolist())
        for i, n in enumerate(lengths)
    ]


def test_concurrent_requests_form_one_batch_matching_single_forwards(
    batching: ReferenceServer, single_model: Any
) -> None:
    clear_dump_dir(batching.dump_dir)
    reqs = _lengths_requests([3, 40, 257, 12, 1000, 64], "b")
    before = _batches(batching)
    answers = _post_concurrently(batching, reqs)
    assert [r.status_code for r in answers] == [200] * len(reqs)
    assert [r.json()["meta_info"]["id"] for r in answers] == [rid for rid, _ in reqs]
    assert _batches(batching) == before + 1  # all six in one forward
    dumps = _dumps_by_rid(batching, len(reqs))
    assert sorted(dumps) == sorted(rid for rid, _ in reqs)  # one dump per request
    for rid, ids in reqs:
        dump = read_dump(dumps[rid], expected_for(ids, rid))
        single = single_model.forward(ids)
        for got, want in (
            (dump.aux_hidden_states, single.aux),
            (dump.last_hidden_state, single.last),
        ):
            c = closeness(got, want)
            assert c.ok, (rid, len(ids), c)


def test_max_batch_tokens_and_requests_split_batches(server_factory: Factory) -> None:
    srv = server_factory(
        "--max-batch-requests", "2", "--max-batch-tokens", "100", name="split"
    ).wait_ready()
    # FIFO, at most 2 requests and 100 padded tokens (requests x longest):
    # [60], [60], [30, 30], [20, 40], [150 alone]
    reqs = _lengths_requests([60, 60, 30, 30, 20, 40, 150], "s")
    before = _batches(srv)
    answers = _post_concurrently(srv, reqs)
    assert [r.status_code for r in answers] == [200] * len(reqs)
    assert _batches(srv) - before == 5
    assert len(_dumps_by_rid(srv, len(reqs))) == len(reqs)


def test_max_batch_requests_1_runs_one_request_per_forward_bit_exact(
    server_factory: Factory, single_model: Any
) -> None:
    srv = server_factory("--max-batch-requests", "1", name="one").wait_ready()
    reqs = _lengths_requests([7, 90, 33], "o")
    before = _batches(srv)
    answers = _post_concurrently(srv, reqs)
    assert [r.status_code for r in answers] == [200] * len(reqs)
    assert _batches(srv) - before == len(reqs)
    dumps = _dumps_by_rid(srv, len(reqs))
    indices = sorted(read_meta(p).request_index for p in dumps.values())
    assert indices == list(range(indices[0], indices[0] + len(reqs)))
    for rid, ids in reqs:
        dump = read_dump(dumps[rid], expected_for(ids, rid))
        single = single_model.forward(ids)
        assert torch.equal(dump.aux_hidden_states, single.aux)
        assert torch.equal(dump.last_hidden_state, single.last)


def test_faults_stay_per_request_inside_a_batch(
    batching: ReferenceServer, single_model: Any
) -> None:
    from hsq.dump.format import fingerprint

    clear_dump_dir(batching.dump_dir)
    reqs = _lengths_requests([20, 21, 22, 23, 24], "f")
    (nan_rid, nan_ids), (short_rid, short_ids), (err_rid, err_ids) = reqs[1], reqs[2], reqs[4]
    set_faults(
        batching,
        {"mode": "nan", "fingerprint": fingerprint(nan_ids)},
        {"mode": "wrong_count", "fingerprint": fingerprint(short_ids)},
        {"mode": "http_500", "fingerprint": fingerprint(err_ids)},
    )
    try:
        httpx.post(batching.url + "/admin/pause").raise_for_status()
        with ThreadPoolExecutor(len(reqs)) as pool:
            try:
                futures = {rid: pool.submit(generate, batching.url, ids, rid) for rid, ids in reqs}
                assert futures[err_rid].result().status_code == 500  # refused before queueing
                _wait_pending(batching, len(reqs) - 1)
            finally:
                httpx.post(batching.url + "/admin/resume").raise_for_status()
            codes = {rid: f.result().status_code for rid, f in futures.items()}
    finally:
        httpx.delete(batching.url + "/admin/faults").raise_for_status()
    assert codes == {rid: (500 if rid == err_rid else 200) for rid, _ in reqs}
    dumps = _dumps_by_rid(batching, len(reqs) - 1)
    assert err_rid not in dumps
    with pytest.raises(errors.NonFiniteDumpError):
        read_dump(dumps[nan_rid], expected_for(nan_ids, nan_rid))
    with pytest.raises(errors.WrongLengthError):
        read_dump(dumps[short_rid], expected_for(short_ids, short_rid))
    for rid, ids in (reqs[0], reqs[3]):  # neighbours in the batch are untouched
        dump = read_dump(dumps[rid], expected_for(ids, rid))
        assert closeness(dump.last_hidden_state, single_model.forward(ids).last).ok


def test_closeness_bound() -> None:
    a = torch.randn(5, 64)
    assert closeness(a, a).ok and closeness(a, a).min_cosine == 1.0
    assert closeness(a + 1e-4 * torch.randn(5, 64), a).ok
    bad = a.clone()
    bad[2, 3] += 0.5 * float(a[2].norm())
    c = closeness(bad, a)
    assert not c.ok and c.max_abs_over_norm >= 0.499  # 0.5 in exact arithmetic
    assert closeness(torch.zeros(2, 4), torch.zeros(2, 4)).ok


def test_batch_shapes_cover_every_batch_the_engine_can_form() -> None:
    from hsq.engines.reference.model import batch_shapes, bucket_length

    shapes = set(batch_shapes(2048, 4, 3000))
    for longest in range(1, 2049):
        for rows in range(1, 5):
            if rows == 1 or rows * longest <= 3000:
                assert (rows, bucket_length(longest)) in shapes, (rows, longest)
    assert max(r * n for r, n in shapes) <= 4 * 1024  # never far above the budget


def test_a_causal_lm_checkpoint_loads_without_a_load_report_but_other_keys_are_reported(
    tmp_path: Path,
) -> None:
    """The server's decoder has no LM head: transformers logged `LlamaModel LOAD REPORT
    ... lm_head.weight | UNEXPECTED` at every start from a *ForCausalLM checkpoint. Only
    the head is quiet: a key the decoder should have had is still reported. (Read from
    transformers' own logger: its handler keeps whichever stderr it was made with.)"""
    import logging

    from safetensors.torch import load_file, save_file

    from tests.support.tinymodel import build

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.texts: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.texts.append(record.getMessage())

    def load_reports() -> list[str]:
        seen = Records()
        root = logging.getLogger("transformers")
        root.addHandler(seen)
        try:
            load_model(str(ckpt), device="cpu", dtype=torch.float32, dump_dtype=torch.float32,
                       layers=None)  # fmt: skip
        finally:
            root.removeHandler(seen)
        return [t for t in seen.texts if "LOAD REPORT" in t]

    ckpt = build(tmp_path / "ckpt")
    assert load_reports() == []
    weights = load_file(ckpt / "model.safetensors")
    weights["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    reports = load_reports()
    assert len(reports) == 1 and "layers.0.extra.weight" in reports[0], reports
    assert "lm_head" not in reports[0], reports
