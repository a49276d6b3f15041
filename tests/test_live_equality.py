"""The live equality check (tests/gpu/equality.py) and the routing proxy
(tests/gpu/proxy.py) without a GPU: synthetic states and a real HTTP upstream."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.gpu import equality as eq  # noqa: E402
from tests.gpu.proxy import RoutingProxy  # noqa: E402

T, H, LAYERS = 12, 32, 6


def _states(seed: int, t: int = T) -> dict[int | str, Any]:
    g = torch.Generator().manual_seed(seed)
    out: dict[int | str, Any] = {i: torch.randn(t, H, generator=g) for i in range(LAYERS)}
    out["last"], out["prenorm"] = torch.randn(t, H, generator=g), torch.randn(t, H, generator=g)
    return out


def _noisy(want: dict[str, Any], scale: float = 1e-4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(99)
    return {
        k: v + scale * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in want.items()
    }


def test_correct_states_pass_and_every_planted_fault_fails() -> None:
    ids = [1, 2, 4]
    a, b = _states(0), _states(1)
    want_a = eq.expected_tensors(a, ids, prenorm=True, fp8=False)
    want_b = eq.expected_tensors(b, ids, prenorm=True, fp8=False)
    stored_a, stored_b = _noisy(want_a), _noisy(want_b)
    ok = eq.compare(stored_a, want_a)
    assert ok.ok and ok.rows == T and ok.min_cosine > 0.9999
    off = eq.expected_tensors(a, eq.shifted(ids, LAYERS), prenorm=False, fp8=False)
    assert not eq.compare({eq.AUX: stored_a[eq.AUX]}, {eq.AUX: off[eq.AUX]}).ok
    assert not eq.compare(stored_b, want_a).ok  # another sample's states
    stale = eq.compare(eq.with_row(stored_a, stored_b, 5, 5), want_a)
    assert not stale.ok and stale.bad_rows == 1 and stale.cosines[5] < 0.9
    shift = eq.compare(eq.with_row(stored_a, stored_a, 5, 4), want_a)
    assert not shift.ok and shift.bad_rows == 1


def test_moe_rule_allows_routing_flips_past_the_dense_prefix_and_catches_every_fault() -> None:
    """Without the server's expert choices (equality.compare_moe): aux id 1 is strict,
    ids 2 and 4 and the final states may differ on a few rows (routing flips)."""
    ids = [1, 2, 4]
    a, b = _states(0), _states(1)
    want_a = eq.expected_tensors(a, ids, prenorm=False, fp8=False)
    want_b = eq.expected_tensors(b, ids, prenorm=False, fp8=False)
    stored_a, stored_b = _noisy(want_a), _noisy(want_b)

    def judge(got: dict[str, Any], want: dict[str, Any]) -> eq.Comparison:
        return eq.compare_moe(got, want, aux_layers=len(ids), dense_aux=1)

    flipped = {k: v.clone() for k, v in stored_a.items()}
    flipped[eq.AUX][2, H:] = want_b[eq.AUX][2, H:]  # token 2 routed elsewhere past layer 1
    flipped[eq.LAST_NAME][2] = want_b[eq.LAST_NAME][2]
    assert not eq.compare(flipped, want_a).ok  # the strict rule calls it a fault
    c = judge(flipped, want_a)
    assert c.ok and c.bad_rows == 1
    many = {k: v.clone() for k, v in stored_a.items()}
    many[eq.LAST_NAME][: T // 2] = want_b[eq.LAST_NAME][: T // 2]  # past the allowance
    assert not judge(many, want_a).ok
    dense_flip = {k: v.clone() for k, v in stored_a.items()}
    dense_flip[eq.AUX][2, :H] = want_b[eq.AUX][2, :H]  # a row no routing can reach
    assert not judge(dense_flip, want_a).ok
    off = eq.expected_tensors(a, eq.shifted(ids, LAYERS), prenorm=False, fp8=False)
    assert not judge({eq.AUX: stored_a[eq.AUX]}, {eq.AUX: off[eq.AUX]}).ok
    assert not judge(stored_b, want_a).ok
    assert not judge(eq.with_row(stored_a, stored_b, 5, 5), want_a).ok
    assert not judge(eq.with_row(stored_a, stored_a, 5, 4), want_a).ok


def test_fp8_outputs_are_held_to_the_reference_quantized() -> None:
    from hsq import quant

    ids = [0, 3]
    want = eq.expected_tensors(_states(2), ids, prenorm=False, fp8=True)
    exact = eq.expected_tensors(_states(2), ids, prenorm=False, fp8=False)
    q, s = quant.quantize(exact[eq.AUX], len(ids))
    stored = {eq.AUX: quant.dequantize(q, s), eq.LAST_NAME: want[eq.LAST_NAME]}
    assert eq.compare(stored, want, fp8=True).ok


def test_shifted_ids_stay_inside_the_model() -> None:
    assert eq.shifted([2, 3, 5], 6) == [1, 2, 4]
    assert eq.shifted([1, 2], 6) == [2, 3]


def test_distribution_summary() -> None:
    d = eq.Distribution("x")
    d.add(eq.Comparison(3, 1, 0.5, 0.2, (1.0, 0.99995, 0.5)))
    d.add(eq.Comparison(2, 0, 0.9999, 0.0, (0.9999, 1.0)), rows=[0])
    s = d.summary()
    assert s["samples"] == 2 and s["samples_failed"] == 1 and s["rows"] == 4
    assert s["hist"] == {"<0.5": 0, "0.5-0.9": 1, "0.9-0.99": 0, "0.99-0.999": 0,
                         "0.999-0.9999": 0, ">=0.9999": 3}  # fmt: skip
    assert s["quantiles"]["q0"] == 0.5


class _Upstream:
    """A fake SGLang /generate that answers with routed experts, over real HTTP."""

    def __init__(self, layers: int, k: int) -> None:
        self.bodies: list[dict[str, Any]] = []
        up = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Type") != "application/json":
                    # SGLang (FastAPI) reads a body without it as bytes: 400, every sample
                    # dead (the 2026-12-01 live run through the proxy)
                    data = b'{"message": "Input should be a dictionary"}'
                    self.send_response(400)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                body = json.loads(raw)
                up.bodies.append(body)
                n = len(body["input_ids"])
                experts = np.arange(n * layers * k, dtype=np.int32) % 8
                meta = {"prompt_tokens": n, "cached_tokens": 0,
                        "routed_experts": base64.b64encode(experts.tobytes()).decode()}  # fmt: skip
                data = json.dumps({"meta_info": meta, "output_ids": [7]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture
def upstream() -> Iterator[_Upstream]:
    up = _Upstream(LAYERS, 2)
    yield up
    up.http.shutdown()
    up.http.server_close()


def test_proxy_records_routing_and_answers_like_the_server(upstream: _Upstream) -> None:
    from hsq.workers.send.client import ServerClient

    ids = [1, 5, 6, 7]
    with RoutingProxy(upstream.url, num_layers=LAYERS, top_k=2) as proxy:
        client = ServerClient(proxy.url)
        try:
            answer = client.prefill(ids, "hsq-x-1")
            assert client.healthy()
        finally:
            client.close()
        assert answer.prompt_tokens == 4 and "routed_experts" not in answer.raw["meta_info"]
        sent = upstream.bodies[0]
        assert sent["return_routed_experts"] is True
        assert sent["sampling_params"]["max_new_tokens"] == 1  # routing for every prompt row
        (routed,) = proxy.for_input(ids)
        assert routed.rid == "hsq-x-1" and routed.experts.shape == (4, LAYERS, 2)
        assert proxy.for_input([1, 2]) == [] and not proxy.errors


def test_proxy_reports_an_unreachable_server_as_unavailable() -> None:
    from hsq.errors import ServerUnavailableError
    from hsq.node.procs import free_port
    from hsq.workers.send.client import ServerClient

    with RoutingProxy(f"http://127.0.0.1:{free_port()}", num_layers=2, top_k=1) as proxy:
        client = ServerClient(proxy.url)
        try:
            with pytest.raises(ServerUnavailableError):
                client.prefill([1, 2], "hsq-y")
        finally:
            client.close()
        assert httpx.get(proxy.url + "/health").status_code == 503
