"""HTTP front of the reference server: the subset of SGLang's API that hsq uses.

    POST /generate      {input_ids, sampling_params: {max_new_tokens: 0}, rid}
    GET  /health        200 once the model is loaded and warmed up
    GET  /model_info    model_path, architectures, is_generation (+ hsq's model identity)
    GET  /server_info   the resolved settings (disable_radix_cache, chunked_prefill_size, ...)
    GET|POST|DELETE /admin/faults   read, replace or clear the fault rules (reference only)
    POST /admin/pause, /admin/resume   hold forwards so queued requests form one batch

/admin/* is off (403) unless the server was started with --admin, and then answers only
loopback peers, or, with --admin-token-file, only requests carrying that token (a fault
rule from another local user made a run's states another sample's). Request bodies
are bounded by what --max-tokens allows (body_limit), not by the generic 64 MiB.

The HTTP side is hsq.engines.http_api's (routing, body limits, error replies): one
thread per connection hands its request to the engine, which gathers concurrent requests
into batched forwards.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import signal
import time
from dataclasses import asdict
from http import HTTPStatus
from typing import Any

import structlog

from hsq.dump.format import DTYPES, expected_shapes
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.engines.http_api import (
    ApiServer,
    Authorize,
    Forbidden,
    Headers,
    RequestError,
    Route,
    sglang_routes,
)
from hsq.engines.http_api import Handler as RouteHandler
from hsq.engines.reference.dumper import DumpWriter
from hsq.engines.reference.engine import Engine, InjectedServerError
from hsq.engines.reference.faults import FaultPlan, FaultRule
from hsq.engines.reference.model import HiddenStateModel, load_model
from hsq.engines.reference.settings import ReferenceSettings
from hsq.errors import ConfigError
from hsq.states import FP8, SCALE_SUFFIX

log = structlog.get_logger("hsq.reference.app")


class ReferenceApp:
    def __init__(self, engine: Engine, settings: ReferenceSettings) -> None:
        self.engine = engine
        self.settings = settings

    def routes(self) -> dict[Route, RouteHandler]:
        faults = self.engine.faults
        return {
            **sglang_routes(self.generate, self.server_info, self.model_info),
            ("GET", "/admin/faults"): lambda _b: {"rules": [r.to_dict() for r in faults.rules()]},
            ("POST", "/admin/faults"): self.set_faults,
            ("DELETE", "/admin/faults"): self.clear_faults,
            ("POST", "/admin/pause"): lambda _b: self._hold(True),
            ("POST", "/admin/resume"): lambda _b: self._hold(False),
            ("POST", "/flush_cache"): lambda _b: None,
        }

    def _hold(self, pause: bool) -> dict[str, Any]:
        if pause:
            self.engine.pause()
        else:
            self.engine.resume()
        return {"pending": self.engine.pending}

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

    def clear_faults(self, _body: Any) -> dict[str, Any]:
        self.engine.faults.replace([])
        return {"rules": []}

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

    return engine.ctx.ready_marker("hsq-reference", hsq.__version__)


ADMIN_PREFIX = "/admin/"
BODY_BYTES_PER_TOKEN = 24
"""A token id in JSON: up to 20 digits (int64) and ", "; SGLang's ids are far shorter."""
BODY_BASE_BYTES = 64 * 1024
"""Everything else a /generate or /admin body holds (rid, sampling_params, fault rules)."""


def body_limit(max_tokens: int) -> int:
    """The largest request body a server of --max-tokens can need, not 64 MiB for
    every server."""
    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_tokens


def admin_guard(settings: ReferenceSettings) -> Authorize:
    """The check every request passes before it is read: /admin/* only with --admin, then
    from loopback, or with the token of --admin-token-file (required from everyone)."""
    token = None
    if settings.admin_token_file is not None:
        try:
            token = settings.admin_token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --admin-token-file: {exc.strerror}") from exc
        if not token:
            raise ConfigError("--admin-token-file is empty")

    def authorize(path: str, peer: str, headers: Headers) -> None:
        if not path.startswith(ADMIN_PREFIX):
            return
        if not settings.admin:
            raise Forbidden("the admin endpoints are off: start the server with --admin")
        if token is not None:
            given = headers.get("X-Hsq-Admin-Token") or ""
            bearer = headers.get("Authorization") or ""
            if bearer.startswith("Bearer "):
                given = given or bearer.removeprefix("Bearer ")
            if not hmac.compare_digest(given.strip().encode(), token.encode()):
                raise Forbidden("an admin request needs the token of --admin-token-file")
            return
        try:
            loopback = ipaddress.ip_address(peer.removeprefix("::ffff:")).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise Forbidden("admin requests only from loopback (or give --admin-token-file)")

    return authorize


HOLD_START_ENV = "HSQ_TEST_HOLD_START_UNTIL"
"""A test hook, off unless set: the server holds its start (in its `loading` phase, not
listening, no ready marker) until the file this names exists, as a large model's load or
SGLang's compile holds a real one for minutes (tests/test_run_starting.py)."""


def hold_start_for_tests() -> None:
    path = os.environ.get(HOLD_START_ENV)
    if not path:
        return
    log.warning("start_held_by_test_hook", until=path)
    while not os.path.exists(path):
        time.sleep(0.1)


def serve(settings: ReferenceSettings) -> None:
    """Load, warm up, then serve until SIGTERM/SIGINT; pending dumps are flushed on exit."""
    guard = admin_guard(settings)  # before the model loads: a bad token file fails fast
    # The phases by name: `hsq run` shows a starting server's last one (loading, warming up).
    log.info("loading_model", model=settings.model, device=settings.device)
    hold_start_for_tests()
    engine = build_engine(settings)
    if settings.warmup_shapes or settings.warmup:
        log.info("warming_up", requests=settings.warmup, shapes=settings.warmup_shapes)
    if settings.warmup_shapes:
        engine.warmup_shapes()
    engine.warmup(settings.warmup)
    if settings.ready_marker:  # before /health answers: a worker checks it at start-up
        write_ready(settings.dump_dir, ready_marker(engine), fsync=settings.fsync)
    server = ApiServer(
        (settings.host, settings.port),
        ReferenceApp(engine, settings).routes(),
        refusals={
            ConfigError: HTTPStatus.BAD_REQUEST,
            InjectedServerError: HTTPStatus.INTERNAL_SERVER_ERROR,
        },
        max_body_bytes=body_limit(settings.max_tokens),
        authorize=guard,
    )
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
        server.serve_until_signal(
            lambda signum: log.info("shutting_down", signal=signal.Signals(signum).name)
        )
    finally:
        engine.writer.flush()
        engine.writer.close()
        log.info("stopped", requests=engine.requests)
