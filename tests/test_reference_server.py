"""The reference server as a real subprocess over real HTTP: API, dumps, faults."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from hsq import errors
from hsq.procs import ReferenceServer
from hsq.protocol import clear_dump_dir, read_dump, read_meta, scan, wait_for_dump
from sglang_server.reference.engine import CRASH_EXIT_CODE
from sglang_server.reference.model import load_model
from tests.conftest import expected_for, generate

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


def _fault_dump_error(srv: ReferenceServer, mode: str) -> errors.DumpError:
    set_faults(srv, {"mode": mode, "times": 1})
    ids = IDS[:10]
    assert generate(srv.url, ids, f"f-{mode}").status_code == 200
    with pytest.raises(errors.DumpError) as info:
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
    time.sleep(0.5)
    parts = scan(clean.dump_dir).complete
    assert len(parts) == 2
    metas = [read_meta(p) for p in parts]
    assert [m.num_tokens for m in metas] == [len(IDS) // 2, len(IDS) - len(IDS) // 2]
    assert {m.rid for m in metas} == {"s"}


def test_fault_bound_to_one_input_fingerprint(clean: ReferenceServer) -> None:
    from hsq.protocol import fingerprint

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


def test_two_processes_give_bit_identical_states(
    server: ReferenceServer, server_factory: Factory
) -> None:
    other = server_factory("--warmup", "1", name="twin").wait_ready()
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


def test_sigterm_stops_the_server_cleanly(server_factory: Factory) -> None:
    srv = server_factory(name="term").wait_ready()
    assert generate(srv.url, IDS, "t").status_code == 200
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(15) == 0
    read_dump(wait_for_dump(srv.dump_dir, timeout=1), expected_for(IDS, "t"))
