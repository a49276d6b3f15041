"""The reference server's admin endpoints and request bodies, with
real `hsq serve-reference` processes and raw HTTP.

Before: /admin/faults answered anyone (another local user set `mix`, a 40-sample run ended
with 24 samples holding another's states; `crash` stopped the server). Now /admin/* is off
unless the server is started with --admin, and then only for loopback peers, or for
requests with the --admin-token-file token.
And a 100,000-deep JSON body and `Content-Length: abc` got 500; bodies up to 64 MiB were
read whatever --max-tokens allowed (four 60 MB bodies: +1.8 GB RSS)."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from hsq.engines.http_api import Forbidden
from hsq.engines.reference.app import admin_guard, body_limit
from hsq.engines.reference.settings import ReferenceSettings
from hsq.errors import ConfigError
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
RULES = {"rules": [{"mode": "mix"}]}


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[ReferenceServer]:
    """As an operator starts it: no --admin."""
    srv = ReferenceServer(
        tmp_path / "dumps", tmp_path / "server.log", args=["--threads", "1"], admin=False
    )
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def generate(url: str, n: int = 4) -> httpx.Response:
    body = {"input_ids": list(range(1, n + 1)), "sampling_params": {"max_new_tokens": 0}}
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_admin_endpoints_are_off_unless_the_server_is_started_with_admin(
    plain: ReferenceServer,
) -> None:
    """Before the fix: 200, and the rule applied to every later request."""
    for method, path, body in (
        ("POST", "/admin/faults", RULES),
        ("POST", "/admin/faults", {"rules": [{"mode": "crash"}]}),
        ("GET", "/admin/faults", None),
        ("DELETE", "/admin/faults", None),
        ("POST", "/admin/pause", {}),
    ):
        r = httpx.request(method, plain.url + path, json=body, timeout=30)
        assert r.status_code == 403, (path, r.text)
        assert "start the server with --admin" in r.json()["error"]["message"]
    r = generate(plain.url)
    assert r.status_code == 200 and plain.proc.poll() is None  # no crash rule took
    assert "fault_mix" not in plain.log_path.read_text()


def test_with_admin_and_a_token_file_only_requests_with_the_token_pass(
    tmp_path: Path, server_factory: Factory
) -> None:
    token = tmp_path / "admin-token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    srv = server_factory("--admin-token-file", str(token), name="tok").wait_ready()
    url = srv.url + "/admin/faults"
    assert httpx.post(url, json=RULES, timeout=30).status_code == 403  # loopback, no token
    wrong = {"X-Hsq-Admin-Token": "s3cret-tokem"}
    assert httpx.post(url, json=RULES, headers=wrong, timeout=30).status_code == 403
    ok = httpx.post(url, json=RULES, headers={"Authorization": "Bearer s3cret-token"}, timeout=30)
    assert ok.status_code == 200, ok.text
    got = httpx.get(url, headers={"X-Hsq-Admin-Token": "s3cret-token"}, timeout=30)
    assert got.json()["rules"][0]["mode"] == "mix"
    assert "s3cret" not in srv.log_path.read_text()  # the token is never logged


def test_the_admin_guard_refuses_peers_that_are_not_loopback() -> None:
    """Pure: the peer address decides when no token is set."""
    guard = admin_guard(ReferenceSettings(dump_dir=Path("/tmp/x"), admin=True))
    for peer in ("127.0.0.1", "127.0.0.7", "::1", "::ffff:127.0.0.1"):
        guard("/admin/faults", peer, {})
    for peer in ("10.0.0.5", "192.168.1.2", "::ffff:10.0.0.5", "2001:db8::1", "bogus"):
        with pytest.raises(Forbidden, match="only from loopback"):
            guard("/admin/faults", peer, {})
    guard("/generate", "10.0.0.5", {})  # the API itself is for everyone the bind allows
    with pytest.raises(ConfigError, match="needs --admin"):
        ReferenceSettings(dump_dir=Path("/tmp/x"), admin_token_file=Path("/t")).validate()


def raw_request(url: str, head: str, body: bytes = b"") -> tuple[int, str]:
    """One request written byte for byte (httpx would fix a bad header)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.read().decode()


def test_bad_bodies_and_headers_get_4xx_and_the_server_stays_up(plain: ReferenceServer) -> None:
    """Before the fix: 500 for the deep body and `Content-Length: abc`; the 60 MB body read."""
    deep = b"[" * 100_000 + b"]" * 100_000
    nested = b'{"input_ids": ' + b"[" * 100 + b"1" + b"]" * 100 + b"}"  # parses; too deep
    cases: list[tuple[str, bytes]] = [
        (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(deep)}\r\n", deep),
        (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(nested)}\r\n", nested),
        ("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n", b""),
        ("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n", b""),
        ("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 60000000\r\n", b"[1"),
    ]
    for head, body in cases:
        status, text = raw_request(plain.url, head, body)
        assert 400 <= status < 500, (head[:60], status, text[:200])
    assert "body larger than" in raw_request(plain.url, cases[-1][0], b"")[1]
    assert generate(plain.url).status_code == 200 and plain.proc.poll() is None


def test_the_body_limit_follows_max_tokens(server_factory: Factory) -> None:
    """A request of --max-tokens ids with the largest ids JSON can carry fits; a body
    past the limit is refused unread."""
    srv = server_factory("--max-tokens", "64", name="lim").wait_ready()
    limit = body_limit(64)
    assert limit < 100 * 1024  # not 64 MiB
    big = {"input_ids": [2**63 - 1] * 64, "rid": "x" * 200}
    assert len(json.dumps(big)) < limit
    r = httpx.post(srv.url + "/generate", content=b" " * (limit + 1), timeout=30)
    assert r.status_code == 400 and "body larger than" in r.text
    assert generate(srv.url).status_code == 200
