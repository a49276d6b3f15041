"""The worker's HTTP transport to its inference server: keep-alive HTTP/1.1 on the standard
library's http.client, a connection per request in flight.

Why not httpx here: a prefill's POST cost ~1,190 us of the worker interpreter's CPU through
httpx (its client layer ~350, httpcore and h11 the rest) against ~330 us through
http.client, measured against the null server on the 2-core machine (the worker's one
interpreter is its ceiling on short samples). httpx stays for tests, as a transport
(`HttpxTransport`, e.g. over httpx.MockTransport), and for hsq's other commands.

Errors are hsq's: a connection that cannot be made is `ConnectFailure` (a
ServerUnavailableError: not the sample's fault); one that breaks or times out once the
request is on its way is `MidRequestFailure` (the server probably died on the sample), and
so is an answer shorter than its own framing says (a body cut before its Content-Length,
a chunked body without its last chunk): never a bad answer nor a stored sample. One
exception: a *reused* connection that fails before any byte of the answer came is
`StaleConnection` (the server closed it while idle, as uvicorn's keep-alive timeout does,
without `Connection: close`, and the close crossed the request on the wire); the caller
sends the request again once, on a fresh connection (`fresh=True`). An idle connection
whose close has already arrived is dropped before reuse (its socket reads as ready), as
httpcore does.

The timeout (`request_timeout`, or a call's own) is one deadline for the whole request:
connect, send, status line and headers, body. A server that trickles its answer a byte at
a time cannot hold a request past it (a per-read timeout would restart at every byte).
"""

from __future__ import annotations

import http.client
import io
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from hsq.errors import ServerUnavailableError

if TYPE_CHECKING:
    import httpx
    from _typeshed import WriteableBuffer

MAX_IDLE = 1024
"""Idle connections kept (a worker has at most 2K requests in flight: hsq/workers/inflight.py)."""

# A connection closed (FIN or RST) under a request: on a reused connection with no answer
# byte yet, the idle close crossing the request; after that, a crash. A timeout is never one.
_CLOSED = (ConnectionError, ssl.SSLEOFError)


class ConnectFailure(ServerUnavailableError):
    """No connection could be made (refused, unreachable, connect timeout, TLS handshake):
    the server is down or restarting, not the sample's fault."""


class MidRequestFailure(ServerUnavailableError):
    """The connection broke or timed out after the request was sent, or the answer was cut
    short of its framing: the server probably crashed on the sample. Counted per sample;
    the dead letter records ``reason``."""

    reason = "server_crash"


class StaleConnection(MidRequestFailure):
    """The request failed on a reused keep-alive connection before any byte of an answer
    came: the server closed the idle connection as the request went out. That says nothing
    of the sample nor of the server's health, so the caller sends it again once, on a fresh
    connection (``fresh=True``), and charges nothing unless that one fails too. Uncaught it
    is what it was before: a mid-request failure."""


class Transport(Protocol):
    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout: float | None,
        limit: int,
        fresh: bool = False,
    ) -> tuple[int, bytes | None]:
        """(status, body); body None if it is longer than `limit` (read no further).
        ``fresh``: on a new connection, never an idle one."""
        ...

    def close(self) -> None: ...


def _declared_over(content_length: str | None, limit: int) -> bool:
    """Whether an answer's Content-Length says it is longer than `limit`."""
    return content_length is not None and content_length.isdigit() and int(content_length) > limit


class _TimedSocket:
    """A connection's socket under the deadline of the request it carries.

    http.client calls ``sendall`` and ``close`` on its connection's socket and reads the
    answer through ``makefile("rb")``; each of those waits here for at most what is left
    of the deadline. ``received`` counts the answer's bytes so far (whether a failure came
    before any of them), ``eof`` says the server closed its side. As with socket.makefile,
    a close waits for the answer's stream to be closed too: http.client closes a
    `Connection: close` answer's connection before its body is read."""

    __slots__ = ("_closing", "_readers", "deadline", "eof", "raw", "received")

    def __init__(self, raw: socket.socket) -> None:
        self.raw = raw
        self.deadline = 0.0
        self.received = 0
        self.eof = False
        self._readers = 0
        self._closing = False

    def start(self, deadline: float) -> None:
        self.deadline = deadline
        self.received = 0
        self.eof = False

    def _wait_at_most(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out: the request's deadline passed")
        self.raw.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._wait_at_most()  # sendall's timeout bounds the whole call (Python >= 3.5)
        self.raw.sendall(data)

    def recv_into(self, buf: WriteableBuffer) -> int:
        self._wait_at_most()
        n = self.raw.recv_into(buf)
        self.received += n
        self.eof = self.eof or n == 0
        return n

    def makefile(self, mode: str) -> io.BufferedReader:
        assert mode == "rb", mode
        self._readers += 1
        return io.BufferedReader(_Reads(self))

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self._closing = True
        if self._readers <= 0:
            self.raw.close()

    def _reader_closed(self) -> None:
        self._readers -= 1
        if self._closing and self._readers <= 0:
            self.raw.close()


class _Reads(io.RawIOBase):
    """An answer's stream (an HTTPResponse's `fp`), read under the request's deadline."""

    def __init__(self, sock: _TimedSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buf: WriteableBuffer) -> int:
        return self._sock.recv_into(buf)

    def close(self) -> None:
        if not self.closed:
            self._sock._reader_closed()
        super().close()


@dataclass(slots=True)
class _Conn:
    http: http.client.HTTPConnection
    sock: _TimedSocket

    def drop(self) -> None:
        """Closed for good, whatever of the answer was left unread."""
        self.http.close()
        self.sock.raw.close()


def _dropped(conn: _Conn) -> bool:
    """Whether an idle connection's socket is readable: closed by the server (or sending
    what nobody asked for): either way not one to send on."""
    p = select.poll()
    p.register(conn.sock.raw, select.POLLIN | select.POLLERR | select.POLLHUP)
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
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, deadline: float) -> _Conn:
        timeout = min(self.connect_timeout, deadline - time.monotonic())
        if timeout <= 0:
            raise ConnectFailure(f"{self.base_url} unreachable: no time left to connect")
        conn: http.client.HTTPConnection
        if self._tls is not None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=self._tls
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            conn.connect()
        except OSError as exc:  # refused, unreachable, connect timeout, TLS handshake
            conn.close()
            raise ConnectFailure(f"{self.base_url} unreachable: {exc!r}") from exc
        sock = _TimedSocket(conn.sock)
        conn.sock = sock
        return _Conn(conn, sock)

    def _take(self, deadline: float) -> tuple[_Conn, bool]:
        """An idle connection (True: reused) or a new one."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(deadline), False
            if not _dropped(conn):
                return conn, True
            conn.drop()

    def _give(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.drop()

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout: float | None,
        limit: int,
        fresh: bool = False,
    ) -> tuple[int, bytes | None]:
        deadline = time.monotonic() + (self.request_timeout if timeout is None else timeout)
        conn, reused = (self._connect(deadline), False) if fresh else self._take(deadline)
        conn.sock.start(deadline)
        headers = {"content-type": "application/json"} if body is not None else {}
        try:
            conn.http.request(method, self._prefix + path, body=body, headers=headers)
            resp = conn.http.getresponse()
            if conn.sock.eof:  # http.client takes a header block cut by the close as whole
                raise http.client.HTTPException("the connection closed inside the headers")
            if _declared_over(resp.getheader("content-length"), limit):
                conn.drop()
                return resp.status, None
            data = resp.read(limit + 1)
            if len(data) > limit:
                conn.drop()
                return resp.status, None
            if resp.length:  # http.client returns a body cut short of its Content-Length
                raise http.client.IncompleteRead(data, resp.length)
        except (OSError, http.client.HTTPException) as exc:
            conn.drop()
            if reused and conn.sock.received == 0 and isinstance(exc, _CLOSED):
                raise StaleConnection(
                    f"{self.base_url} closed a kept-alive connection under the request: {exc!r}"
                ) from exc
            raise MidRequestFailure(f"{self.base_url} failed mid-request: {exc!r}") from exc
        if resp.will_close or not resp.isclosed():  # reuse only a stream read to its end
            conn.drop()
        else:
            self._give(conn)
        return resp.status, data

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.drop()


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
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout: float | None,
        limit: int,
        fresh: bool = False,  # noqa: ARG002 (the tests' transports hold no connections)
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
            raise ConnectFailure(f"{self.base_url} unreachable: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise MidRequestFailure(f"{self.base_url} failed mid-request: {exc!r}") from exc

    def close(self) -> None:
        self._http.close()
