"""The server side of SGLang's HTTP API, as much of it as hsq speaks, for the servers that
are not SGLang: the reference server (hsq/engines/reference/app.py), the null-model
server (tests/support/nullserver.py), the tests' misbehaving server (tests/hostile.py), and
the vLLM-shaped test server (tests/support/fakevllm.py, vLLM's completions route).

One stdlib threading server: routes by (method, path), JSON replies, request bodies read
within a size limit (the body is untrusted: a bad or oversized Content-Length is refused
and the connection closed, never read; JSON nested deeper than jsonsafe.MAX_DEPTH is a
400), an optional `authorize` hook that may refuse a request by its path, peer and headers
before it is read (Forbidden: 403), and SGLang's error shape
``{"error": {"message": ..., "code": status}}``. A handler's exception becomes that reply:
the server's ``refusals`` map types to a status (RequestError: 400), anything else is a
500 with its cause, logged, and the server keeps serving. A handler may answer with a
`Reply` to run work once its answer is written. Connections stay open (HTTP/1.1 keep-alive)
for the worker's http.client transport (hsq/workers/send/http.py).
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import structlog

from hsq import jsonsafe

log = structlog.get_logger("hsq.http_api")
MAX_BODY_BYTES = 64 * 1024 * 1024

Route = tuple[str, str]
"""(method, path)."""
Handler = Callable[[Any], Any]
"""The request's JSON body (None for GET and DELETE) -> the JSON answer (None: empty), or a
Reply."""


@dataclass(frozen=True)
class Reply:
    """An answer, and work to run once it is written: the order of a server that acts after
    answering (vLLM's connector saves a request's states an engine step later)."""

    body: Any
    then: Callable[[], None]


class RequestError(ValueError):
    """A request the server refuses (HTTP 400)."""


class Forbidden(RequestError):
    """A request this client may not make (HTTP 403)."""


class Headers(Protocol):
    def get(self, name: str, default: None = None) -> str | None: ...


Authorize = Callable[[str, str, Headers], None]
"""(path, peer address, headers) -> None, or raise Forbidden."""


def prefill_answer(rid: str, prompt_tokens: int, e2e_s: float) -> dict[str, Any]:
    """The shape of SGLang's /generate answer to a prefill-only request."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "e2e_latency": round(e2e_s, 6),
        },
    }


def sglang_routes(
    generate: Handler, server_info: Callable[[], Any], model_info: Callable[[], Any]
) -> dict[Route, Handler]:
    """SGLang's endpoints that hsq uses, with their older names."""
    routes: dict[Route, Handler] = {("POST", "/generate"): generate}
    for path in ("/health", "/health_generate"):
        routes["GET", path] = lambda _body: None  # 200 once the model is loaded
    for path in ("/server_info", "/get_server_info"):
        routes["GET", path] = lambda _body: server_info()
    for path in ("/model_info", "/get_model_info"):
        routes["GET", path] = lambda _body: model_info()
    return routes


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        routes: Mapping[Route, Handler],
        *,
        refusals: Mapping[type[Exception], int] | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        backlog: int | None = None,
        authorize: Authorize | None = None,
    ) -> None:
        self.routes = dict(routes)
        # Most specific first: status_for takes the first kind that matches.
        self.refusals: dict[type[Exception], int] = {Forbidden: int(HTTPStatus.FORBIDDEN)}
        self.refusals.update(refusals or {})
        self.refusals.setdefault(RequestError, int(HTTPStatus.BAD_REQUEST))
        self.max_body_bytes = max_body_bytes
        self.authorize = authorize
        if backlog is not None:
            self.request_queue_size = backlog  # read by server_activate(), in __init__
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def status_for(self, exc: Exception) -> int | None:
        """The status a refused request gets; None: not a refusal (a 500)."""
        for kind, status in self.refusals.items():
            if isinstance(exc, kind):
                return status
        return None

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="http", daemon=True)
        thread.start()
        return thread

    def serve_until_signal(self, on_signal: Callable[[int], None] | None = None) -> None:
        """Serve until SIGTERM or SIGINT (``on_signal`` hears which), then close."""

        def stop(signum: int, _frame: object) -> None:
            if on_signal is not None:
                on_signal(signum)
            threading.Thread(target=self.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            self.serve_forever(poll_interval=0.2)
        finally:
            self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle plus the
    # client's delayed ACK add ~40 ms to every keep-alive request.
    disable_nagle_algorithm = True
    server: ApiServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # access logs would drown the servers' structured per-request lines

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        try:
            if self.server.authorize is not None:
                self.close_connection = True  # until allowed: a refused body stays unread
                self.server.authorize(self.path, str(self.client_address[0]), self.headers)
                self.close_connection = False
            body = self._body() if method == "POST" else None
            route = self.server.routes.get((method, self.path))
            if route is None:
                self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
                return
            answer = route(body)
            if isinstance(answer, Reply):
                self._send(HTTPStatus.OK, answer.body)
                answer.then()
            else:
                self._send(HTTPStatus.OK, answer)
        except Exception as exc:
            status = self.server.status_for(exc)
            if status is None:  # keep serving; the client sees a 500 with the cause
                log.exception("request_failed", path=self.path)
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
            else:
                self._error(status, str(exc))

    def _body(self) -> Any:
        declared = self.headers.get("Content-Length") or "0"
        limit = self.server.max_body_bytes
        digits = declared.isascii() and declared.isdigit()  # int() refuses '²', isdigit not
        if not digits or int(declared) > limit:
            self.close_connection = True  # the body stays unread: nothing after it is a request
            if not digits:
                raise RequestError(f"bad Content-Length {declared[:40]!r}")
            raise RequestError(f"body larger than {limit} bytes")
        length = int(declared)
        raw = self.rfile.read(length) if length else b""
        try:
            value = jsonsafe.loads(raw or b"null")
        except ValueError as exc:  # not JSON, not UTF-8, or nested too deeply to parse
            raise RequestError(f"body is not valid JSON: {exc}") from exc
        if jsonsafe.too_deep(value):  # parsed, but no handler should walk it
            raise RequestError(f"body nests deeper than {jsonsafe.MAX_DEPTH} levels")
        return value

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "code": int(status)}})
