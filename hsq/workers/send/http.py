"""The worker's HTTP transport to its inference server: keep-alive HTTP/1.1 on the standard
library's http.client, a connection per request in flight.

Why not httpx here: a prefill's POST cost ~1,190 us of the worker interpreter's CPU through
httpx (its client layer ~350, httpcore and h11 the rest) against ~330 us through
http.client, measured against the null server on the 2-core machine (the worker's one
interpreter is its ceiling on short samples). httpx stays for tests, as a transport
(`HttpxTransport`, e.g. over httpx.MockTransport), and for hsq's other commands.

Errors are hsq's: a connection that cannot be made is `ServerUnavailableError` (not the
sample's fault); one that breaks or times out once the request is on its way is
`MidRequestFailure` (the server probably died on the sample). An idle connection the server
closed is dropped before reuse (its socket reads as ready), as httpcore does.
"""

from __future__ import annotations

import http.client
import select
import ssl
import threading
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from hsq.errors import ServerUnavailableError

if TYPE_CHECKING:
    import httpx

MAX_IDLE = 1024
"""Idle connections kept (a worker has at most 2K requests in flight: hsq/workers/inflight.py)."""


class MidRequestFailure(ServerUnavailableError):
    """The connection broke or timed out after the request was sent: the server probably
    crashed on the sample. Counted per sample; the dead letter records ``reason``."""

    reason = "server_crash"


class Transport(Protocol):
    def request(
        self, method: str, path: str, body: bytes | None, *, timeout: float | None, limit: int
    ) -> tuple[int, bytes | None]:
        """(status, body); body None if it is longer than `limit` (read no further)."""
        ...

    def close(self) -> None: ...


def _declared_over(content_length: str | None, limit: int) -> bool:
    """Whether an answer's Content-Length says it is longer than `limit`."""
    return content_length is not None and content_length.isdigit() and int(content_length) > limit


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection's socket is readable: closed by the server (or sending
    what nobody asked for): either way not one to send on."""
    sock = conn.sock
    if sock is None:
        return True
    p = select.poll()
    p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(p.poll(0))


class StdlibTransport:
    """Thread-safe: each request takes an idle connection or makes one."""

    def __init__(self, base_url: str, *, request_timeout: float, connect_timeout: float) -> None:
        parts = urlsplit(base_url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_url = base_url
        self._https = scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        # https: the default trust store, loaded once; http:// loads no CA bundle (30-50 ms
        # of CPU at every worker start).
        self._tls = ssl.create_default_context() if self._https else None
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._tls is not None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self.connect_timeout, context=self._tls
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self.connect_timeout)
        try:
            conn.connect()
        except OSError as exc:  # refused, unreachable, connect timeout, TLS handshake
            conn.close()
            raise ServerUnavailableError(f"{self.base_url} unreachable: {exc!r}") from exc
        return conn

    def _take(self) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect()
            if not _dropped(conn):
                return conn
            conn.close()

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def request(
        self, method: str, path: str, body: bytes | None, *, timeout: float | None, limit: int
    ) -> tuple[int, bytes | None]:
        conn = self._take()
        assert conn.sock is not None
        conn.sock.settimeout(self.request_timeout if timeout is None else timeout)
        headers = {"content-type": "application/json"} if body is not None else {}
        try:
            conn.request(method, self._prefix + path, body=body, headers=headers)
            resp = conn.getresponse()
            if _declared_over(resp.getheader("content-length"), limit):
                conn.close()
                return resp.status, None
            data = resp.read(limit + 1)
            if len(data) > limit:
                conn.close()
                return resp.status, None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise MidRequestFailure(f"{self.base_url} failed mid-request: {exc!r}") from exc
        if resp.will_close or not resp.isclosed():  # reuse only a stream read to its end
            conn.close()
        else:
            self._give(conn)
        return resp.status, data

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class HttpxTransport:
    """The same port over an httpx transport (tests: httpx.MockTransport), with httpx's
    errors mapped as StdlibTransport maps its own."""

    def __init__(
        self,
        base_url: str,
        transport: httpx.BaseTransport,
        *,
        request_timeout: float,
        connect_timeout: float,
    ) -> None:
        from hsq.extras import PRETTY, hidden

        with hidden(*PRETTY):  # for httpx's own command line, never used here
            import httpx

        self.base_url = base_url
        self._httpx = httpx
        self._http = httpx.Client(
            base_url=base_url,
            timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
            transport=transport,
        )

    def request(
        self, method: str, path: str, body: bytes | None, *, timeout: float | None, limit: int
    ) -> tuple[int, bytes | None]:
        httpx = self._httpx
        headers = {"content-type": "application/json"} if body is not None else {}
        limits = self._http.timeout if timeout is None else httpx.Timeout(timeout)
        try:
            with self._http.stream(
                method, path, content=body, headers=headers, timeout=limits
            ) as r:
                if _declared_over(r.headers.get("content-length"), limit):
                    return r.status_code, None
                buf = bytearray()
                for chunk in r.iter_bytes():
                    buf += chunk
                    if len(buf) > limit:
                        return r.status_code, None
                return r.status_code, bytes(buf)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise ServerUnavailableError(f"{self.base_url} unreachable: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise MidRequestFailure(f"{self.base_url} failed mid-request: {exc!r}") from exc

    def close(self) -> None:
        self._http.close()
