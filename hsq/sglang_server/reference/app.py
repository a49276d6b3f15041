"""HTTP front of the reference server: the subset of SGLang's API that hsq uses.

    POST /generate      {input_ids, sampling_params: {max_new_tokens: 0}, rid}
    GET  /health        200 once the model is loaded and warmed up
    GET  /model_info    model_path, architectures, is_generation (+ hsq's model identity)
    GET  /server_info   the resolved settings (disable_radix_cache, chunked_prefill_size, ...)
    GET|POST|DELETE /admin/faults   read, replace or clear the fault rules (reference only)
    POST /admin/pause, /admin/resume   hold forwards so queued requests form one batch

A stdlib threading server is enough: one thread per connection hands its request to the
engine, which gathers concurrent requests into batched forwards; connections stay open
(HTTP/1.1 keep-alive) for the worker's httpx client.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import asdict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog

from hsq import jsonsafe
from hsq.dump.format import DTYPES, expected_shapes
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.errors import ConfigError
from hsq.sglang_server.reference.dumper import DumpWriter
from hsq.sglang_server.reference.engine import Engine, InjectedServerError, RequestError
from hsq.sglang_server.reference.faults import FaultPlan, FaultRule
from hsq.sglang_server.reference.model import HiddenStateModel, load_model
from hsq.sglang_server.reference.settings import ReferenceSettings
from hsq.states import FP8, SCALE_SUFFIX

log = structlog.get_logger("hsq.reference.app")
MAX_BODY_BYTES = 64 * 1024 * 1024


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle plus the
    # client's delayed ACK add ~40 ms to every keep-alive request.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # access logs would drown the structured per-request line

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "code": status}})

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise RequestError(f"body larger than {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length) if length else b""
        try:
            return jsonsafe.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"body is not valid JSON: {exc}") from exc

    def do_GET(self) -> None:
        app = self.server.app
        if self.path in ("/health", "/health_generate"):
            self._send(HTTPStatus.OK, None)
        elif self.path in ("/model_info", "/get_model_info"):
            self._send(HTTPStatus.OK, app.model_info())
        elif self.path in ("/server_info", "/get_server_info"):
            self._send(HTTPStatus.OK, app.server_info())
        elif self.path == "/admin/faults":
            self._send(HTTPStatus.OK, {"rules": [r.to_dict() for r in app.engine.faults.rules()]})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def do_DELETE(self) -> None:
        if self.path == "/admin/faults":
            self.server.app.engine.faults.replace([])
            self._send(HTTPStatus.OK, {"rules": []})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def do_POST(self) -> None:
        try:
            body = self._body()
            if self.path == "/generate":
                self._send(HTTPStatus.OK, self.server.app.generate(body))
            elif self.path == "/admin/faults":
                self._send(HTTPStatus.OK, self.server.app.set_faults(body))
            elif self.path in ("/admin/pause", "/admin/resume"):
                engine = self.server.app.engine
                if self.path == "/admin/pause":
                    engine.pause()
                else:
                    engine.resume()
                self._send(HTTPStatus.OK, {"pending": engine.pending})
            elif self.path == "/flush_cache":
                self._send(HTTPStatus.OK, None)
            else:
                self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
        except (RequestError, ConfigError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except InjectedServerError as exc:
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc))
        except Exception as exc:  # keep serving; the client sees a 500 with the cause
            log.exception("request_failed")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    app: ReferenceApp


class ReferenceApp:
    def __init__(self, engine: Engine, settings: ReferenceSettings) -> None:
        self.engine = engine
        self.settings = settings

    def generate(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise RequestError("body must be a JSON object")
        if "input_ids" not in body:
            raise RequestError("input_ids is required (the reference server has no tokenizer)")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object")
        if params.get("max_new_tokens", 0) != 0:
            raise RequestError("only prefill is supported: set sampling_params.max_new_tokens=0")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise RequestError("rid must be a string")
        t0 = time.perf_counter()
        result = self.engine.generate(body["input_ids"], rid)
        e2e = time.perf_counter() - t0
        log.info(
            "generate",
            rid=result.rid,
            index=result.index,
            tokens=result.prompt_tokens,
            forward_ms=round(result.forward_s * 1e3, 2),
            batch=result.batch_size,
            e2e_ms=round(e2e * 1e3, 2),
            fault=result.fault,
        )
        return result.to_sglang(e2e)

    def set_faults(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("rules"), list):
            raise RequestError('expected {"rules": [{"mode": ..., ...}, ...]}')
        rules = []
        for raw in body["rules"]:
            if not isinstance(raw, dict):
                raise RequestError("each rule must be an object")
            rules.append(FaultRule.from_dict(raw))
        self.engine.faults.replace(rules)
        log.info("faults_set", rules=[r.to_dict() for r in rules])
        return {"rules": [r.to_dict() for r in rules]}

    def model_info(self) -> dict[str, Any]:
        m = self.engine.model
        return {
            "model_path": self.settings.model,
            "tokenizer_path": None,
            "is_generation": True,
            "architectures": [m.identity.architecture],
            "hsq": {
                "model_id": m.identity.model_id,
                "identity": asdict(m.identity),
                "layer_ids": m.layer_ids,
                "hidden_size": m.hidden_size,
                "dump_dtype": str(m.dump_dtype).removeprefix("torch."),
                "dump_encoding": self.engine.encoding,
                "prenorm": m.prenorm,
                "vocab_size": m.vocab_size,
            },
        }

    def server_info(self) -> dict[str, Any]:
        s = self.settings
        return {
            "server": "hsq-reference",
            "model_path": s.model,
            "device": s.device,
            "dtype": s.compute_dtype,
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
            "max_tokens": s.max_tokens,
            "max_batch_requests": self.engine.max_batch_requests,
            "max_batch_tokens": s.max_batch_tokens,
            "batches_run": self.engine.batches,
            "pending_requests": self.engine.pending,
            "dump_dir": str(s.dump_dir),
            "request_counter": self.engine.counter,
            "requests_served": self.engine.requests,
        }


def build_engine(settings: ReferenceSettings) -> Engine:
    import torch

    settings.validate()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    settings.dump_dir.mkdir(parents=True, exist_ok=True)
    model = load_model(
        settings.model,
        device=settings.device,
        dtype=DTYPES[settings.compute_dtype],
        dump_dtype=DTYPES[settings.dump_dtype],
        layers=list(settings.layers) if settings.layers else None,
        seed=settings.seed,
        prenorm=settings.prenorm,
    )
    per_token = dump_bytes_per_token(model, settings.dump_encoding)
    # One host buffer holds a whole batch (one device-to-host copy per forward); a single
    # request may exceed --max-batch-tokens (it then runs alone).
    batch_requests = settings.max_batch_requests or (8 if model.device.type == "cuda" else 1)
    batch_tokens = settings.max_tokens
    if batch_requests > 1:
        batch_tokens = max(batch_tokens, settings.max_batch_tokens)
    writer = DumpWriter(
        settings.dump_dir,
        depth=settings.writer_depth,
        fsync=settings.fsync,
        device=model.device,
        max_bytes=batch_tokens * per_token + 1024,  # + each tensor's 64-byte alignment
        threads=settings.writer_threads,
    )
    faults = FaultPlan([FaultRule.parse(f) for f in settings.faults], seed=settings.seed)
    return Engine(
        model,
        writer,
        faults,
        max_tokens=settings.max_tokens,
        counter_start=settings.counter_start,
        max_batch_requests=batch_requests,
        max_batch_tokens=settings.max_batch_tokens,
        encoding=settings.dump_encoding,
    )


def dump_bytes_per_token(
    model: HiddenStateModel, encoding: str, *, prenorm: bool | None = None
) -> int:
    """Host bytes one token's dump tensors take (the pinned ring is sized from it);
    `prenorm` None: as the model captures."""
    pre = model.prenorm if prenorm is None else prenorm
    shapes = expected_shapes(
        1, len(model.layer_ids), model.hidden_size, encoding=encoding, prenorm=pre
    )
    if encoding == FP8:  # one byte a value, float32 scales
        return sum(s[1] * (4 if n.endswith(SCALE_SUFFIX) else 1) for n, s in shapes.items())
    return sum(s[1] for s in shapes.values()) * model.dump_dtype.itemsize


def ready_marker(engine: Engine) -> ReadyMarker:
    import hsq

    m = engine.model
    return ReadyMarker(
        layer_ids=tuple(m.layer_ids),
        model=m.identity,
        server="hsq-reference",
        server_version=hsq.__version__,
        hook_version=hsq.__version__,
        pid=os.getpid(),
        created_unix=time.time(),
        encoding=engine.encoding,
        prenorm=m.prenorm,
    )


def serve(settings: ReferenceSettings) -> None:
    """Load, warm up, then serve until SIGTERM/SIGINT; pending dumps are flushed on exit."""
    engine = build_engine(settings)
    if settings.warmup_shapes:
        engine.warmup_shapes()
    engine.warmup(settings.warmup)
    if settings.ready_marker:  # before /health answers: a worker checks it at start-up
        write_ready(settings.dump_dir, ready_marker(engine), fsync=settings.fsync)
    server = _Server((settings.host, settings.port), _Handler)
    server.app = ReferenceApp(engine, settings)

    def stop(signum: int, _frame: object) -> None:
        log.info("shutting_down", signal=signal.Signals(signum).name)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = server.server_address[:2]
    log.info(
        "ready",
        host=host,
        port=port,
        model_id=engine.model.identity.model_id,
        layer_ids=engine.model.layer_ids,
        dump_dir=str(settings.dump_dir),
        counter=engine.counter,
        max_batch_requests=engine.max_batch_requests,
        max_batch_tokens=engine.max_batch_tokens,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        engine.writer.flush()
        engine.writer.close()
        log.info("stopped", requests=engine.requests)
