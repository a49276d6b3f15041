"""The worker's http.client transport (hsq/workers/send/http.py) against real sockets: what each
way a connection can fail maps to, keep-alive reuse, a server that closed an idle
connection (before the request, or under it), the body limit, the request's one deadline
(a server that trickles its answer) and answers cut short of their framing."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from hsq.errors import ServerUnavailableError
from hsq.workers.policy import Outcome, classify, decide
from hsq.workers.send.client import ServerClient
from hsq.workers.send.http import MidRequestFailure, StaleConnection, StdlibTransport

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
    with pytest.raises(MidRequestFailure) as info:
        transport(srv.url).request("POST", "/generate", b"{}", timeout=None, limit=100)
    assert not isinstance(info.value, StaleConnection)  # a new connection: never stale


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
    idle = t._idle[0].sock.raw
    idle.settimeout(5)
    assert idle.recv(1, socket.MSG_PEEK) == b""
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


def answers_then_closes(body: bytes, answers: int = 1, then: bytes = b"") -> Reply:
    """Answers ``answers`` requests on each connection, kept alive (no `Connection: close`),
    then closes it under the next request after sending ``then`` (nothing: a keep-alive
    timeout that crossed the request on the wire)."""
    count: dict[int, int] = {}

    def reply(conn: socket.socket, _head: bytes) -> bool:
        n = count[id(conn)] = count.get(id(conn), 0) + 1
        if n > answers:
            conn.sendall(then)
            return False
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        return True

    return reply


def test_a_request_the_idle_close_crossed_is_stale_and_goes_again_on_a_fresh_connection(
    serve: Callable[[Reply], RawServer],
) -> None:
    """Issue 42 D4: a server that closes a kept-alive connection as the next request
    arrives (uvicorn's idle timeout) had that request charged as a server crash."""
    srv = serve(answers_then_closes(b'{"a": 1}'))
    t = transport(srv.url)
    assert t.request("POST", "/generate", b"{}", timeout=None, limit=100) == (200, b'{"a": 1}')
    with pytest.raises(StaleConnection):  # the reused connection, closed under the request
        t.request("POST", "/generate", b"{}", timeout=None, limit=100)
    again = t.request("POST", "/generate", b"{}", timeout=None, limit=100, fresh=True)
    assert again == (200, b'{"a": 1}')
    assert srv.connections == 2
    # /health is asked again by the client itself: no rid, nothing to match.
    client = ServerClient(srv.url, request_timeout=5)
    try:
        assert client.healthy() and client.healthy() and client.healthy()
    finally:
        client.close()
    # The client's three: the first answered, each later one went again on a fresh one.
    assert srv.connections == 5


def test_a_reused_connection_that_broke_after_answer_bytes_is_mid_request_not_stale(
    serve: Callable[[Reply], RawServer],
) -> None:
    srv = serve(answers_then_closes(b"x", then=b"HTTP/1.1 200 OK\r\ncontent-le"))
    t = transport(srv.url)
    assert t.request("GET", "/health", None, timeout=1, limit=9) == (200, b"x")
    with pytest.raises(MidRequestFailure) as info:
        t.request("GET", "/health", None, timeout=1, limit=9)
    assert not isinstance(info.value, StaleConnection)


def trickle(answer: bytes, every_s: float, sent: list[int]) -> Reply:
    """Sends ``answer`` one byte every ``every_s`` seconds, counting the bytes that went."""

    def reply(conn: socket.socket, _head: bytes) -> bool:
        for i in range(len(answer)):
            try:
                conn.sendall(answer[i : i + 1])
            except OSError:  # the client gave up
                return False
            sent[0] += 1
            threading.Event().wait(every_s)
        return False

    return reply


@pytest.mark.parametrize("part", ["head", "body"])
def test_the_request_timeout_is_one_deadline_for_the_whole_request(
    serve: Callable[[Reply], RawServer], part: str
) -> None:
    """Issue 42 D5: a server trickling its answer a byte every 0.3 s held a request 37.9 s
    under --request-timeout 3 (the timeout was per socket read). Each byte here comes well
    within the timeout, the whole answer far after it: the request fails mid-request, and
    the server never got to send all of it."""
    body = b"y" * 40
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
    sent = [0]
    if part == "head":  # the status line and headers trickle, the body would come at once
        srv = serve(trickle(head, 0.05, sent))
    else:

        def slow_body(conn: socket.socket, h: bytes) -> bool:
            conn.sendall(head)
            sent[0] += len(head)
            return trickle(body, 0.05, sent)(conn, h)

        srv = serve(slow_body)
    with pytest.raises(MidRequestFailure) as info:
        transport(srv.url, timeout=0.5).request("POST", "/generate", b"{}", timeout=None, limit=99)
    assert "timed out" in str(info.value)
    assert sent[0] < len(head) + (len(body) if part == "body" else 0)


def cut(answer: bytes) -> Reply:
    def reply(conn: socket.socket, _head: bytes) -> bool:
        conn.sendall(answer)
        return False  # then closed

    return reply


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b'{"meta_info": {"prompt',
        # still parses as JSON: only its Content-Length says that it is not all of it
        b"HTTP/1.1 200 OK\r\ncontent-length: 60\r\n\r\n" + b'{"a": 1}',
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n8\r\n" + b'{"a": 1}\r\n',
        b"HTTP/1.1 200 OK\r\ncontent-type: applic",  # http.client saw a whole header block
    ],
    ids=["cut", "cut-but-parses", "chunked-without-its-last-chunk", "cut-in-the-headers"],
)
def test_an_answer_cut_short_of_its_framing_is_a_mid_request_failure(
    serve: Callable[[Reply], RawServer], answer: bytes
) -> None:
    """Issue 42 D6: a 200 whose body stopped short of its Content-Length was a bad answer
    (server_error, then dead) or, when it still parsed, a complete one. It is a failure
    mid-request now: the sample is handed back, never stored, never server_error."""
    srv = serve(cut(answer))
    with pytest.raises(MidRequestFailure) as info:
        transport(srv.url).request("POST", "/generate", b"{}", timeout=None, limit=1000)
    assert not isinstance(info.value, StaleConnection)
    client = ServerClient(srv.url, request_timeout=5)
    try:
        with pytest.raises(MidRequestFailure) as through_client:
            client.prefill([1, 2, 3], "hsq-s1-a0-00000000")
    finally:
        client.close()
    failure = classify(through_client.value)
    assert failure.reason == "server_crash" and failure.mid_request
    assert decide(failure, 0, 3, crashes=1).outcome is Outcome.HAND_BACK
