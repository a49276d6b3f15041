"""The worker's vLLM client against a real HTTP server on a socket. The server is a fake
that mimics the shape of vLLM 0.26's /v1/completions answer (read in
vllm/entrypoints/openai/completion/protocol.py and serving.py), not vLLM itself: it records
what the client sent and answers as told."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hsq.engines.vllm import config as connector_config
from hsq.errors import ConfigError, ServerRejectedError, ServerUnavailableError
from hsq.workers.send.client import RID_PARAM, ServerClient, VllmClient, make_client
from hsq.workers.settings import EngineApi, WorkerSettings


class FakeVllm(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]]
    reply: tuple[int, bytes] | None = None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.bodies.append((self.path, body))  # type: ignore[attr-defined]
        status, data = self.server.reply or (200, completion(body))  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


def completion(body: dict[str, Any], details: dict[str, Any] | None = None) -> bytes:
    n = len(body["prompt"])
    return json.dumps(
        {
            "id": f"cmpl-{body['request_id']}",
            "object": "text_completion",
            "model": body.get("model", "tiny"),
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": n,
                "completion_tokens": 1,
                "total_tokens": n + 1,
                "prompt_tokens_details": details,
            },
            "kv_transfer_params": {"hsq_rid": body["kv_transfer_params"]["hsq_rid"]},
        }
    ).encode()


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    srv.bodies = []  # type: ignore[attr-defined]
    srv.reply = None  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_a_prefill_is_one_completion_with_the_rid_for_the_connector(server: Any) -> None:
    client = VllmClient(url(server), model="tiny")
    answer = client.prefill([5, 6, 7], "hsq-1-a0-0badcafe")
    assert (answer.prompt_tokens, answer.cached_tokens) == (3, 0)
    path, body = server.bodies[0]
    assert path == "/v1/completions"
    assert body == {
        "prompt": [5, 6, 7],
        "max_tokens": 1,
        "temperature": 0.0,
        "request_id": "hsq-1-a0-0badcafe",
        "kv_transfer_params": {"hsq_rid": "hsq-1-a0-0badcafe"},
        "model": "tiny",
    }
    assert client.healthy()
    VllmClient(url(server)).prefill([1], "r")  # no --served-model: vLLM takes its only model
    assert "model" not in server.bodies[1][1]


def test_cached_tokens_are_read_from_the_details(server: Any) -> None:
    body = {"prompt": [1, 2], "request_id": "r", "kv_transfer_params": {"hsq_rid": "r"}}
    server.reply = (200, completion(body, {"cached_tokens": 2}))
    assert VllmClient(url(server)).prefill([1, 2], "r").cached_tokens == 2


@pytest.mark.parametrize(
    ("reply", "error", "status"),
    [
        (
            (400, b'{"error": {"message": "prompt too long", "code": 400}}'),
            ServerRejectedError,
            400,
        ),
        ((503, b"{}"), ServerUnavailableError, None),
        ((200, b'{"usage": {}}'), ServerRejectedError, 502),
        ((200, b'{"usage": {"prompt_tokens": "3"}}'), ServerRejectedError, 502),
        ((200, b"[1, 2]"), ServerRejectedError, 502),
        ((200, b"not json"), ServerRejectedError, 502),
        ((200, b" " * (2 << 20)), ServerRejectedError, 502),
    ],
)
def test_bad_answers_are_hsq_errors(server: Any, reply: Any, error: Any, status: Any) -> None:
    server.reply = reply
    with pytest.raises(error) as info:
        VllmClient(url(server)).prefill([1], "r")
    if status is not None:
        assert info.value.status_code == status


def test_an_unreachable_server_is_unavailable() -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    port = srv.server_address[1]
    srv.server_close()
    with pytest.raises(ServerUnavailableError):
        VllmClient(f"http://127.0.0.1:{port}", connect_timeout=2).prefill([1], "r")


def test_the_engine_picks_the_client() -> None:
    assert type(make_client("vllm", "http://x", request_timeout=1, model="m")) is VllmClient
    assert type(make_client("sglang", "http://x", request_timeout=1)) is ServerClient
    s = WorkerSettings(
        run="r", server="http://x", dump_dir=Path("/d"), redis_url="", api=EngineApi("tgi")
    )
    with pytest.raises(ConfigError, match="--engine must be one of sglang, vllm"):
        s.validate()


def test_the_rid_key_is_the_connectors() -> None:
    assert RID_PARAM == connector_config.RID_PARAM


def test_the_marker_decides_which_client_is_right() -> None:
    from hsq.dump.format import ModelIdentity
    from hsq.dump.ready import ReadyMarker
    from hsq.engines.vllm.writer import SERVER
    from hsq.errors import HookInactiveError
    from hsq.workers.readiness import check_engine

    def marker(server: str) -> ReadyMarker:
        model = ModelIdentity("m", "LlamaForCausalLM", 4, 16, "0" * 64)
        return ReadyMarker((1,), model, server, "0.26.0", "0", 1, 0.0)

    check_engine(marker(SERVER), "vllm")
    check_engine(marker("sglang"), "sglang")
    check_engine(marker("hsq-reference"), "sglang")
    with pytest.raises(HookInactiveError, match="--engine vllm"):
        check_engine(marker(SERVER), "sglang")
    with pytest.raises(HookInactiveError, match="--engine sglang"):
        check_engine(marker("sglang"), "vllm")
