"""Passwords are never printed, with a real redis-server whose ACL users
have passwords holding each reserved URL character."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from hsq.errors import ConfigError, HsqError
from hsq.node.procs import RedisServer
from hsq.redisurl import read_url_file, redact
from hsq.store import connect
from tests.helpers import hsq

# RFC 3986 gen-delims and sub-delims, `%`, space, quotes and a backslash.
RESERVED = list(":/?#[]@!$&'()*+,;=% \"\\")
PIECES = ("Kq7", "Zx9", "Wv3")


def password(c: str) -> str:
    return c.join(PIECES)


def leaks(text: str) -> list[str]:
    return [p for p in PIECES if p in text]


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Reserved character -> redis://u<N>:PASSWORD@.../0 as a user would type it (raw)."""
    srv = RedisServer(tmp_path_factory.mktemp("redis-acl"), password="admin").wait_ready()
    admin = redis.Redis.from_url(srv.url)
    urls = {}
    for i, c in enumerate(RESERVED):
        name = f"u{i}"
        admin.acl_setuser(
            name, enabled=True, passwords=[f"+{password(c)}"], keys=["*"], commands=["+@all"]
        )
        urls[c] = f"redis://{name}:{password(c)}@127.0.0.1:{srv.port}/0"
    yield urls
    srv.stop()


@pytest.mark.parametrize("c", RESERVED, ids=[f"{ord(c):02x}" for c in RESERVED])
def test_a_password_with_any_reserved_character_is_never_printed(
    users: dict[str, str], c: str
) -> None:
    """Unencoded, the URL either works (the character is unambiguous there) or is refused
    with a message that holds no piece of the password; redact() hides it either way; and
    percent-encoding it, as the message says, always works."""
    raw = users[c]
    assert leaks(redact(raw)) == [], redact(raw)
    try:
        connect(raw).ping()
    except HsqError as exc:
        assert leaks(str(exc)) == [], str(exc)
        if isinstance(exc, ConfigError):
            assert "percent-encode" in str(exc)
    user, rest = raw.removeprefix("redis://").split(":", 1)
    host = rest.rsplit("@", 1)[1]
    assert connect(f"redis://{user}:{quote(password(c), safe='')}@{host}").ping()


def test_the_cli_prints_no_piece_of_an_ambiguous_password(users: dict[str, str]) -> None:
    """The case of the issue: `s@e/cr3t` printed `e/cr3t`; `/`, `#`, `?` printed all of it."""
    for c in "/#?":
        res = hsq("status", "--redis", users[c])
        assert res.returncode == 2, res.stderr
        assert leaks(res.stdout + res.stderr) == [], res.stderr
        assert "***@127.0.0.1" in res.stderr


def test_redis_url_file_reads_the_url_without_quoting_it(
    users: dict[str, str], tmp_path: Path
) -> None:
    f = tmp_path / "url"
    f.write_text(f"\n{users['@']}\n")
    f.chmod(0o600)
    assert read_url_file(f) == users["@"]
    assert hsq("runs", "--redis-url-file", str(f)).returncode == 0
    f.write_bytes(b"\xff" + password("/").encode())
    res = hsq("runs", "--redis-url-file", str(f))
    assert res.returncode == 2 and leaks(res.stderr) == [], res.stderr


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640, 0o604, 0o602])
def test_a_redis_url_file_other_users_may_read_is_refused(
    users: dict[str, str], tmp_path: Path, mode: int
) -> None:
    """A --redis-url-file of mode 0644 or 0666 (every local user reads the
    password in it) was taken without a word. Now it is refused, as ssh refuses such a
    private key: exit 2, the mode and `chmod 600` named, nothing of the file quoted."""
    f = tmp_path / "url"
    f.write_text(users["@"] + "\n")
    f.chmod(mode)
    with pytest.raises(ConfigError, match=f"has mode {mode:04o}: other users") as err:
        read_url_file(f)
    assert f"chmod 600 {f}" in str(err.value) and leaks(str(err.value)) == []
    res = hsq("runs", "--redis-url-file", str(f))
    assert res.returncode == 2 and f"mode {mode:04o}" in res.stderr, res.stderr
    assert leaks(res.stdout + res.stderr) == []
    for fine in (0o600, 0o400):
        f.chmod(fine)
        assert read_url_file(f) == users["@"]
    assert hsq("runs", "--redis-url-file", str(f)).returncode == 0
