"""A misbehaving inference server for tests: real HTTP (a thread of the test process), real
dumps written with hsq.protocol.write_dump into a real dump dir, and a per-request hook that
damages them the way a broken or hostile server would (a FIFO as the tensor file, two full
dumps for one rid). A real `hsq worker` process talks to it like to any server."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from hsq.dump.format import DumpMeta, ModelIdentity, expected_shapes, fingerprint
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.dump.write import write_dump
from hsq.states import AUX_TENSOR, LAST_TENSOR

IDENT = ModelIdentity("hostile", "LlamaForCausalLM", 8, 16, "7" * 64)
LAYERS = [2, 4, 5]
HIDDEN = 16

Writer = Callable[["HostileServer", int, list[int], str], None]
"""(server, request number, input ids, rid): write this request's dump(s)."""


def meta_for(ids: list[int], rid: str) -> DumpMeta:
    n = len(ids)
    return DumpMeta(
        rid=rid,
        num_tokens=n,
        input_fingerprint=fingerprint(ids),
        layer_ids=LAYERS,
        hidden_size=HIDDEN,
        dtype="bfloat16",
        model=IDENT,
        tensors=expected_shapes(n, len(LAYERS), HIDDEN),
        request_index=0,
    )


def tensors_for(ids: list[int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(ids) + len(ids))
    n = len(ids)
    return {
        AUX_TENSOR: torch.randn(n, len(LAYERS) * HIDDEN, generator=gen).to(torch.bfloat16),
        LAST_TENSOR: torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16),
    }


class HostileServer:
    """/generate writes the request's dump through ``writer`` (a good dump by default)."""

    def __init__(self, dump_dir: Path, writer: Writer | None = None) -> None:
        self.dump_dir = dump_dir
        self.writer = writer or HostileServer.good
        self._index = itertools.count()
        self._calls = itertools.count()
        self._lock = threading.Lock()
        dump_dir.mkdir(mode=0o700, exist_ok=True)
        write_ready(dump_dir, ReadyMarker(tuple(LAYERS), IDENT, "hostile", "0", "0", 1, 0.0))
        handler = type("Handler", (_Handler,), {"app": self})
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def next_index(self) -> int:
        with self._lock:
            return next(self._index)

    def good(self, _call: int, ids: list[int], rid: str) -> None:
        write_dump(self.dump_dir, self.next_index(), meta_for(ids, rid), tensors_for(ids))

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        ids, rid = list(body["input_ids"]), str(body["rid"])
        with self._lock:
            call = next(self._calls)
        self.writer(self, call, ids, rid)
        return {"meta_info": {"prompt_tokens": len(ids), "cached_tokens": 0}}

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    app: HostileServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(HTTPStatus.OK, {})  # /health, /server_info

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length))
        self._send(HTTPStatus.OK, self.app.generate(body))


def once_per_sample(damage: Writer) -> Writer:
    """``damage`` for the first request of each distinct input, a good dump after that."""
    seen: set[str] = set()
    lock = threading.Lock()

    def writer(srv: HostileServer, call: int, ids: list[int], rid: str) -> None:
        fp = fingerprint(ids)
        with lock:
            first = fp not in seen
            seen.add(fp)
        (damage if first else HostileServer.good)(srv, call, ids, rid)

    return writer
