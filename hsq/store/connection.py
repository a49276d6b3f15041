"""The connection: connect(), and Redis exceptions as hsq errors (the aggregates' methods
raise only hsq errors: StoreUnavailableError for unreachable or timing out, which is
transient, else StoreError).

connect() reads everything from the URL, TLS files included (`ssl_ca_certs`, `ssl_certfile`,
`ssl_keyfile` query parameters); it reads no environment variable. The CLI folds its
--redis-ca/--redis-cert/--redis-key flags (or their HSQ_REDIS_* variables) into the URL at
the edge (hsq.redisurl.RedisTls), so the values travel with the URL to wherever it goes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import hiredis
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from hsq.errors import ConfigError, StoreError, StoreUnavailableError
from hsq.keys import RUN_CONFIG_GLOB, run_of_config_key
from hsq.redisurl import check_url, redact, scrub

Client = redis.Redis
"""The client type, for modules that hold a connection without importing redis."""
WatchError = redis.exceptions.WatchError
NoPermissionError = redis.exceptions.NoPermissionError
P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


@contextlib.contextmanager
def redis_errors(where: str = "Redis") -> Iterator[None]:
    """Redis exceptions as hsq errors: unreachable is transient, the rest is not."""
    try:
        yield
    except redis.exceptions.AuthenticationError as exc:
        raise StoreError(f"{where} refused the credentials: {exc}") from exc
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise StoreUnavailableError(f"cannot reach {where}: {exc}") from exc
    except redis.exceptions.NoPermissionError as exc:
        raise StoreError(f"the user of {where} lacks a permission hsq needs: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise StoreError(f"{where}: {exc}") from exc


def _translated(fn: Callable[P, R]) -> Callable[P, R]:
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            with redis_errors():
                yield from fn(*args, **kwargs)

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with redis_errors():
            return fn(*args, **kwargs)

    return wrapper


def translate_public(cls: type[T]) -> type[T]:
    """Wrap every public method: callers see hsq errors only, never redis exceptions."""
    for name, attr in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(attr):
            setattr(cls, name, _translated(attr))
    return cls


class UntrustedServerError(redis.exceptions.RedisError):
    """The process behind a unix:// socket is not one this user trusts: nothing was sent.
    Not a ConnectionError, so never retried as a transient fault."""


def trusted_uids(path: str) -> set[int]:
    """Who may serve a unix socket: this user, root, and the owner of the socket's
    directory when only root could have made that directory (its parent is root's and
    writable by no one else: /run/redis/ of a system Redis). A directory in a place others
    can write (/tmp) proves nothing: anyone can make one there once the first is gone."""
    uids = {os.geteuid(), 0}
    parent = os.path.dirname(os.path.abspath(path))
    with contextlib.suppress(OSError):
        d, up = os.lstat(parent), os.lstat(os.path.dirname(parent))
        if not d.st_mode & 0o022 and up.st_uid == 0 and not up.st_mode & 0o022:
            uids.add(d.st_uid)
    return uids


def check_peer(sock: socket.socket, path: str) -> None:
    """Raise UntrustedServerError unless the process on the other end of a connected unix
    socket (SO_PEERCRED: the kernel's word, not the peer's) runs as a trusted user. Called
    right after connect(), before redis-py sends HELLO/AUTH with the password: a stale
    URL file whose socket another user took over gets nothing."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid not in trusted_uids(path):
        raise UntrustedServerError(
            f"the Redis socket {path} is served by uid {uid}, not by you or root: nothing "
            "was sent; the URL file is stale or the socket was taken over"
        )


class PeerCheckedUnixConnection(redis.UnixDomainSocketConnection):
    """A unix-socket connection that checks who serves it before sending anything."""

    def _connect(self) -> socket.socket:
        sock: socket.socket = super()._connect()  # type: ignore[no-untyped-call]
        try:
            check_peer(sock, self.path)
        except BaseException:
            sock.close()
            raise
        return sock


def connect(url: str, *, name: str | None = None) -> Client:
    """A client from a URL (auth, db and TLS files come from it); retries transient
    connection errors. `name`: every connection's CLIENT SETNAME (who is attached). A
    unix:// server is checked before anything is sent (check_peer); a rediss:// one by its
    certificate, against the URL's CA, before AUTH."""
    check_url(url)  # before any parser sees it: a reserved character would leak (redisurl.py)
    extra: dict[str, Any] = {}
    if url.lower().startswith("unix://"):
        extra["connection_class"] = PeerCheckedUnixConnection
    if name is not None:
        extra["client_name"] = name
    try:
        with redis_errors(f"Redis at {redact(url)}"):
            client = redis.Redis.from_url(
                url,
                **extra,
                socket_connect_timeout=5,
                socket_timeout=30,
                health_check_interval=15,
                retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 5),
                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
            )
            client.ping()
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"bad Redis URL {redact(url)}: {scrub(str(exc), url)}") from None
    except StoreError as exc:  # redis-py's messages name what it parsed: never a password
        raise type(exc)(scrub(str(exc), url)) from None
    return client


def packed_call(client: Client, *args: str | bytes | int) -> Any:
    """One idempotent command packed by hiredis in C and sent on one of the client's pooled
    connections, with the client's retries (a retried command runs again: hence idempotent).
    redis-py packs every argument in Python (~0.3 us each); the enqueue's index writes pass
    10,000 at once, ~10 % of its CPU before. Errors are redis-py's, as from any command."""
    return send_packed(client, pack(*args))


def pack(*args: str | bytes | int) -> bytes:
    """One command as RESP bytes, packed by hiredis in C (a scanning process packs the
    index writes beside the enqueue: send_packed sends them)."""
    return hiredis.pack_command(args)  # type: ignore[arg-type,no-any-return]  # stub: 1-tuple


def pack_per_key(command: str, keys: Sequence[str], args: Sequence[str]) -> list[bytes]:
    """`command key *args` for each key, the arguments packed once (the enqueue's three
    HMGETs of one batch of ids: packing is most of their client-side cost)."""
    body = pack(*args)
    body = body[body.index(b"\r\n") + 2 :]  # the arguments without their count
    heads = [pack(command, key) for key in keys]
    n = f"*{len(args) + 2}\r\n".encode()
    return [n + head[head.index(b"\r\n") + 2 :] + body for head in heads]


def send_packed(client: Client, packed: bytes) -> Any:
    """A command `pack` made (idempotent: a retry sends it again), on one of the client's
    pooled connections with its retries; the reply as redis-py parses it."""
    return send_packed_many(client, [packed])[0]


def send_packed_many(client: Client, packed: list[bytes]) -> list[Any]:
    """Idempotent packed commands in one round trip (send_packed); their replies."""
    pool = client.connection_pool
    conn = pool.get_connection()

    def call() -> list[Any]:
        conn.send_packed_command(packed)  # type: ignore[no-untyped-call]
        return [conn.read_response() for _ in packed]

    try:
        return conn.retry.call_with_retry(call, lambda _err: conn.disconnect())  # type: ignore[no-untyped-call]
    finally:
        pool.release(conn)


@dataclass
class RunListing:
    """The runs in a Redis, and what looked like a run but is not one (in words)."""

    runs: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """At most SKIPPED_SHOWN entries, in words; `skipped_total` counts them all."""
    skipped_total: int = 0

    def skip(self, why: str) -> None:
        self.skipped_total += 1
        if len(self.skipped) < SKIPPED_SHOWN:
            self.skipped.append(why)


SKIPPED_SHOWN = 20


def scan_runs(client: Client) -> RunListing:
    """Every run, by SCAN of the config keys (keys.py: no shared listing another run's user
    could empty or fill). A key name that is not a legal run's config key is skipped and
    reported, never fatal. Needs SCAN: an admin or the shared user, not a run's own user."""
    listing = RunListing()
    names: set[str] = set()
    with redis_errors():
        for key in client.scan_iter(match=RUN_CONFIG_GLOB, count=10000, _type="hash"):
            try:
                names.add(run_of_config_key(text(key)))
            except (ValueError, UnicodeDecodeError) as exc:
                listing.skip(str(exc))
    listing.runs = sorted(names)
    return listing


def list_runs(client: Client) -> list[str]:
    """The names of every run (scan_runs without what it skipped)."""
    return scan_runs(client).runs


def redis_calls(client: Client) -> int:
    """Commands Redis executed so far (INFO commandstats, all commands)."""
    with redis_errors():
        stats = client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


def scan_names(client: Client, pattern: str) -> list[str]:
    """Key names matching `pattern` by SCAN; [] for a per-run ACL user, which may not
    SCAN (it would list every run's key names): callers then use the registered workers."""
    try:
        return [text(key) for key in client.scan_iter(match=pattern, count=1000)]
    except redis.exceptions.NoPermissionError:
        return []


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
