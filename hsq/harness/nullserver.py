"""A server whose model costs nothing: the worker's ceiling, measured against it.

Same HTTP API as the reference server for what a worker uses (POST /generate with
input_ids and rid, GET /health, /server_info, /model_info; POST /admin/reset clears the
counts and times /server_info reports), the readiness marker, and one
valid dump per request written with hsq.protocol.write_dump at once: the hidden states are
slices of one preallocated buffer of random, finite values of the chosen shape (H, k aux
layers + the last state, dtype). Everything a worker checks holds: rid, fingerprint, token
count, layers, model identity, shapes, dtype, finite values.

    python -m hsq.harness.nullserver --dump-dir /dev/shm/hsq-null/d0 --port 30000 \\
        --hidden-size 4096 --num-layers 32 --dtype bfloat16

bench/ceiling.py starts it through hsq.harness.procs.NullServer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from hsq.dump.format import DumpMeta, ModelIdentity, expected_shapes, fingerprint
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.dump.write import write_dump
from hsq.states import AUX_TENSOR, LAST_TENSOR

MAX_BODY_BYTES = 64 * 2**20
SHAPES = {
    # name: (hidden size, decoder layers)
    "tiny": (64, 8),
    "8b": (4096, 32),
    "kimi-k2.5": (7168, 61),
}


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers (HF hidden_states indices), as the reference server."""
    return [2, num_layers // 2, num_layers - 3]


class NullModel:
    """The preallocated states and the identity every dump carries."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_layers: int,
        layer_ids: list[int],
        dtype: str,
        max_tokens: int,
        name: str,
        seed: int = 0,
    ) -> None:
        import torch

        from hsq.dump.format import DTYPES

        self.hidden_size = hidden_size
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.identity = ModelIdentity(
            name=name,
            architecture="NullModel",
            num_layers=num_layers,
            hidden_size=hidden_size,
            # Not the seed: servers with other values but the same shape are one model.
            config_digest=f"null-{hidden_size}-{num_layers}-{dtype}".ljust(16, "0"),
        )
        g = torch.Generator().manual_seed(seed)
        k = len(self.layer_ids)
        # Random normal values (finite, as a real model's): a request takes the first rows.
        self.aux = torch.randn(max_tokens, k * hidden_size, generator=g).to(DTYPES[dtype])
        self.last = torch.randn(max_tokens, hidden_size, generator=g).to(DTYPES[dtype])

    def tensors(self, n: int) -> dict[str, Any]:
        return {AUX_TENSOR: self.aux[:n], LAST_TENSOR: self.last[:n]}


class NullApp:
    def __init__(
        self, model: NullModel, dump_dir: Path, *, fsync: bool, answer_delay_s: float = 0.0
    ) -> None:
        self.model = model
        self.dump_dir = dump_dir
        self.fsync = fsync
        self.answer_delay_s = answer_delay_s
        self._lock = threading.Lock()
        self.counter = 0
        self.requests = 0
        self.tokens = 0
        self.first_request_unix: float | None = None
        self.last_request_unix: float | None = None

    def generate(self, body: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list):
            raise ValueError("input_ids (a list of ints) is required")
        ids = body["input_ids"]
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise ValueError("rid (a string) is required: the null server dumps by rid")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict) or params.get("max_new_tokens", 0) != 0:
            raise ValueError("only prefill is supported: sampling_params.max_new_tokens=0")
        n = len(ids)
        if not 0 < n <= self.model.max_tokens:
            raise ValueError(f"{n} tokens; this server takes 1..{self.model.max_tokens}")
        now = time.time()
        with self._lock:
            index = self.counter
            self.counter += 1
            if self.first_request_unix is None:
                self.first_request_unix = now
            self.last_request_unix = now
        m = self.model
        meta = DumpMeta(
            rid=rid,
            num_tokens=n,
            input_fingerprint=fingerprint(ids),
            layer_ids=m.layer_ids,
            hidden_size=m.hidden_size,
            dtype=m.dtype,
            model=m.identity,
            tensors=expected_shapes(n, len(m.layer_ids), m.hidden_size),
            request_index=index,
        )
        write_dump(self.dump_dir, index, meta, m.tensors(n), fsync=self.fsync)
        with self._lock:
            self.requests += 1
            self.tokens += n
        if self.answer_delay_s > 0:  # tests: the dump is there, the answer comes later
            time.sleep(self.answer_delay_s)
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": n,
                "completion_tokens": 0,
                "cached_tokens": 0,
                "e2e_latency": round(time.perf_counter() - t0, 6),
            },
        }

    def reset_stats(self) -> None:
        """Forget the request counts and times (not the dump counter): one bench run each."""
        with self._lock:
            self.requests = self.tokens = 0
            self.first_request_unix = self.last_request_unix = None

    def server_info(self) -> dict[str, Any]:
        with self._lock:
            return {
                "server": "hsq-null",
                "disable_radix_cache": True,
                "chunked_prefill_size": -1,
                "max_tokens": self.model.max_tokens,
                "dump_dir": str(self.dump_dir),
                "request_counter": self.counter,
                "requests_served": self.requests,
                "tokens_served": self.tokens,
                "first_request_unix": self.first_request_unix,
                "last_request_unix": self.last_request_unix,
            }

    def model_info(self) -> dict[str, Any]:
        m = self.model
        return {
            "model_path": m.identity.name,
            "tokenizer_path": None,
            "is_generation": True,
            "architectures": [m.identity.architecture],
            "hsq": {
                "model_id": m.identity.model_id,
                "layer_ids": m.layer_ids,
                "hidden_size": m.hidden_size,
                "dump_dtype": m.dtype,
            },
        }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in separate writes
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        app = self.server.app
        if self.path in ("/health", "/health_generate"):
            self._send(HTTPStatus.OK, None)
        elif self.path in ("/server_info", "/get_server_info"):
            self._send(HTTPStatus.OK, app.server_info())
        elif self.path in ("/model_info", "/get_model_info"):
            self._send(HTTPStatus.OK, app.model_info())
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": "body too large"}})
            self.close_connection = True
            return
        raw = self.rfile.read(length) if length else b""
        if self.path == "/admin/reset":
            self.server.app.reset_stats()
            self._send(HTTPStatus.OK, None)
            return
        if self.path != "/generate":
            self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            self._send(HTTPStatus.OK, self.server.app.generate(json.loads(raw or b"null")))
        except ValueError as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc), "code": 400}})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    app: NullApp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump-dir", type=Path, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="sets H and layers")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--layers", default=None, help="aux layer ids, comma separated")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--name", default=None, help="model name in the identity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fsync", action="store_true", help="fsync dumps (tmpfs needs none)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (start-up only)")
    ap.add_argument(
        "--answer-delay-s", type=float, default=0.0, help="answer this long after the dump"
    )
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, args.threads))
    hidden, layers_n = SHAPES[args.shape] if args.shape else (args.hidden_size, args.num_layers)
    layer_ids = (
        [int(x) for x in args.layers.split(",")] if args.layers else default_layers(layers_n)
    )
    model = NullModel(
        hidden_size=hidden,
        num_layers=layers_n,
        layer_ids=layer_ids,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        name=args.name or f"null-{args.shape or hidden}",
        seed=args.seed,
    )
    args.dump_dir.mkdir(parents=True, exist_ok=True)
    import hsq

    marker = ReadyMarker(
        layer_ids=tuple(layer_ids),
        model=model.identity,
        server="hsq-null",
        server_version=hsq.__version__,
        hook_version=hsq.__version__,
        pid=os.getpid(),
        created_unix=time.time(),
    )
    write_ready(args.dump_dir, marker, fsync=args.fsync)  # before /health answers
    server = _Server((args.host, args.port), _Handler)
    server.app = NullApp(model, args.dump_dir, fsync=args.fsync, answer_delay_s=args.answer_delay_s)

    def stop(_signum: int, _frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(json.dumps({"event": "ready", "port": args.port, "model_id": model.identity.model_id}))
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
