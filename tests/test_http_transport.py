"""The worker's http.client transport (hsq/workers/send/http.py) against real sockets: what each
way a connection can fail maps to, keep-alive reuse, a server that closed an idle
connection, and the body limit."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from hsq.errors import ServerUnavailableError
from hsq.workers.send.http import MidRequestFailure, StdlibTransport

Reply = Callable[[socket.socket, bytes], bool]
"""Given the connection and the request's bytes: answer; True keeps the connection open."""


class RawServer:
    """A one-thread-per-connection TCP server answering each request with `reply`."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                head, sep, rest = buf.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                if len(rest) < length:
                    continue
                buf = rest[length:]
                if not self.reply(conn, head):
                    return

    def close(self) -> None:
        self.sock.close()


def ok(body: bytes) -> Reply:
    def reply(conn: socket.socket, _head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        return True

    return reply


@pytest.fixture
def serve() -> Iterator[Callable[[Reply], RawServer]]:
    servers: list[RawServer] = []

    def start(reply: Reply) -> RawServer:
        servers.append(RawServer(reply))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


_open: list[StdlibTransport] = []


@pytest.fixture(autouse=True)
def _close_transports() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


def transport(url: str, timeout: float = 5.0) -> StdlibTransport:
    _open.append(StdlibTransport(url, request_timeout=timeout, connect_timeout=2.0))
    return _open[-1]


def test_keep_alive_reuses_one_connection(serve: Callable[[Reply], RawServer]) -> None:
    srv = serve(ok(b'{"a": 1}'))
    t = transport(srv.url)
    for _ in range(5):
        assert t.request("POST", "/generate", b"{}", timeout=None, limit=100) == (200, b'{"a": 1}')
    assert srv.connections == 1
    t.close()


def test_a_refused_connection_is_unavailable_not_mid_request() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(ServerUnavailableError) as info:
        transport(f"http://127.0.0.1:{port}").request("GET", "/health", None, timeout=1, limit=9)
    assert not isinstance(info.value, MidRequestFailure)


def test_a_server_that_closes_without_answering_fails_mid_request(
    serve: Callable[[Reply], RawServer],
) -> None:
    srv = serve(lambda _conn, _head: False)  # reads the request, closes: a crash
    with pytest.raises(MidRequestFailure):
        transport(srv.url).request("POST", "/generate", b"{}", timeout=None, limit=100)


def test_a_server_that_stops_answering_times_out_mid_request(
    serve: Callable[[Reply], RawServer],
) -> None:
    hold = threading.Event()

    def hang(_conn: socket.socket, _head: bytes) -> bool:
        hold.wait(10)
        return False

    srv = serve(hang)
    with pytest.raises(MidRequestFailure) as info:
        transport(srv.url, timeout=0.3).request("POST", "/generate", b"{}", timeout=None, limit=9)
    assert "timed out" in str(info.value)
    hold.set()


def test_an_idle_connection_the_server_closed_is_not_reused(
    serve: Callable[[Reply], RawServer],
) -> None:
    srv = serve(ok(b"x"))
    t = transport(srv.url)
    assert t.request("GET", "/health", None, timeout=1, limit=9) == (200, b"x")
    first = srv.conns[0]
    first.shutdown(socket.SHUT_RDWR)  # the server's keep-alive timeout
    first.close()
    # Wait for the close to reach the client's socket: it must read as ready.
    idle = t._idle[0]
    assert idle.sock is not None
    idle.sock.settimeout(5)
    assert idle.sock.recv(1, socket.MSG_PEEK) == b""
    assert t.request("GET", "/health", None, timeout=1, limit=9) == (200, b"x")
    assert srv.connections == 2


def test_a_body_over_the_limit_is_none_and_the_connection_dropped(
    serve: Callable[[Reply], RawServer],
) -> None:
    srv = serve(ok(b"y" * 50))
    t = transport(srv.url)
    assert t.request("POST", "/generate", b"{}", timeout=None, limit=10) == (200, None)
    assert t._idle == []

    def undeclared(conn: socket.socket, _head: bytes) -> bool:  # no length: read to close
        conn.sendall(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"z" * 50)
        return False

    srv2 = serve(undeclared)
    t2 = transport(srv2.url)
    assert t2.request("POST", "/generate", b"{}", timeout=None, limit=10) == (200, None)
    assert t2.request("POST", "/generate", b"{}", timeout=None, limit=100) == (200, b"z" * 50)


def test_a_chunked_answer_is_read_whole(serve: Callable[[Reply], RawServer]) -> None:
    def chunked(conn: socket.socket, _head: bytes) -> bool:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        return True

    srv = serve(chunked)
    t = transport(srv.url)
    assert t.request("POST", "/generate", b"{}", timeout=None, limit=100) == (200, b"abcde")
    assert t.request("POST", "/generate", b"{}", timeout=None, limit=100) == (200, b"abcde")
    assert srv.connections == 1


def test_only_http_urls() -> None:
    with pytest.raises(ValueError):
        transport("unix:///tmp/x")
