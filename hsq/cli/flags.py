"""The flags many commands share, as settings records (hsq.settings.setting), and what they
open: the Redis URL (flag, environment or --redis-url-file) with its TLS files, a run's
store, a run's output directory as mounted here.

A command adds them with `settings_options(RedisFlags)` and reads them back with
`take(RedisFlags, values)` (hsq.cli.options); every one is also an environment variable,
the same one in every command (`--run` is HSQ_RUN, `--redis` HSQ_REDIS_URL or REDIS_URL).
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import click

from hsq.cli.options import on_command_line
from hsq.logs import progress
from hsq.settings import setting

if TYPE_CHECKING:
    from hsq.runstore import RunStore
    from hsq.store import Client

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
REDIS_URL_HELP = (
    "redis://[USER]:PASSWORD@host:port/db or rediss://; the password never as a flag "
    "(environment or --redis-url-file)"
)
TLS_HELP = "rediss:// only: CA bundle, client cert, its key"
"""--help's one row for --redis-ca, --redis-cert and --redis-key (hsq/cli/command.py)."""


@dataclass(frozen=True)
class LogFlags:
    """`hsq`'s own options, before the command or after it (hsq/cli/command.py)."""

    log_level: str = setting(
        "INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="the least severe level logged"
    )
    log_format: str = setting(
        "auto",
        choices=("auto", "json", "console"),
        help="json: one JSON object a line; console: text for a person; auto: console when "
        "stderr is a terminal, else json (a log file, a collector)",
    )


@dataclass(frozen=True)
class RunName:
    run: str = setting(help="run name ([A-Za-z0-9_-])")


@dataclass(frozen=True)
class RedisAccess:
    """How to reach a Redis besides its URL: the URL from a file, the TLS files."""

    redis_url_file: Path | None = setting(
        None,
        path="file",
        help="the URL from this file's first line (chmod 600)",
    )
    redis_ca: Path | None = setting(
        None,
        path="file",
        exists=True,
        help="rediss:// only: CA bundle that signed the Redis server (or URL query "
        "`ssl_ca_certs=`)",
    )
    redis_cert: Path | None = setting(
        None,
        path="file",
        exists=True,
        help="rediss:// only: client certificate, mutual TLS (or URL query `ssl_certfile=`)",
    )
    redis_key: Path | None = setting(
        None,
        path="file",
        exists=True,
        help="rediss:// only: client certificate's private key (or URL query `ssl_keyfile=`)",
    )

    @overload
    def resolve(self, url: str) -> str: ...
    @overload
    def resolve(self, url: None) -> str | None: ...
    def resolve(self, url: str | None) -> str | None:
        """The URL to connect to: `url` (--redis), or the one --redis-url-file holds (a
        password on a command line is visible to every local user in `ps` and /proc), with
        the TLS files in it."""
        if self.redis_url_file is not None:
            if on_command_line("redis_url"):
                raise click.UsageError("give --redis or --redis-url-file, not both")
            url = _url_from_file(self.redis_url_file)
        return None if url is None else tls_into_url(self, url)


def _url_from_file(path: Path) -> str:
    """The URL a file holds; for OUT/.hsq/redis-url, OUT's own Redis, started now for as
    long as this command runs when no `hsq run` runs it (hsq.node.redis.url_for_reader):
    the commands a run prints at its end work as printed after it ended."""
    from hsq.node.redis import is_private_url_file, url_for_reader
    from hsq.redisurl import read_url_file

    if not is_private_url_file(path):
        return read_url_file(path)
    url, redis, lock = url_for_reader(path)
    if redis is not None and lock is not None:
        ctx = click.get_current_context(silent=True)
        stops = (lock.release, redis.stop)
        for stop in stops:  # both run last first: the Redis stops, then the lock goes
            if ctx is not None:
                ctx.find_root().call_on_close(stop)
            else:
                atexit.register(stop)
    return url


def tls_into_url(access: RedisAccess, url: str) -> str:
    """The one place the CLI's TLS files reach hsq.store.connect(): as values, folded into a
    rediss:// URL's query (hsq.redisurl.RedisTls), so they travel with the URL, to the
    processes this one starts too (`hsq demo`'s worker)."""
    from hsq.redisurl import RedisTls

    def text(path: Path | None) -> str | None:
        return None if path is None else str(path)

    tls = RedisTls(text(access.redis_ca), text(access.redis_cert), text(access.redis_key))
    return tls.into_url(url)


@dataclass(frozen=True)
class RedisFlags:
    """The Redis every command but `demo` talks to (`demo` starts its own unless told)."""

    redis_url: str = setting(LOCAL_REDIS, flag="--redis", env=("REDIS_URL",), help=REDIS_URL_HELP)
    access: RedisAccess = field(default_factory=RedisAccess)

    def url(self) -> str:
        return self.access.resolve(self.redis_url)

    def client(self) -> Client:
        """A connected client: every command's one way to Redis."""
        from hsq.store import connect

        return connect(self.url())

    def run_store(self, run: str) -> RunStore:
        """The store of a run that exists: an unknown run is a usage error (exit 2), said in
        plain words."""
        from hsq.runstore import RunStore

        st = RunStore(self.client(), run)
        st.require_config()
        return st


@dataclass(frozen=True)
class MountedOut:
    """For commands that read a run's files: where they are mounted here."""

    out: Path | None = setting(
        None,
        path="dir",
        default_text="the run's",
        help="output root if it is mounted elsewhere here",
    )
    no_progress: bool = setting(False, help="no progress bar")

    def run_dir(self, store: RunStore) -> Path:
        """OUT/RUN/: the run's files, under --out or the root the run recorded."""
        return (self.out or Path(store.require_config().out)) / store.run

    def progress(self, total: int, desc: str) -> Any:
        """A progress bar over the run's files, on stderr (stdout carries the report): a
        tqdm, a context manager with `update`."""
        return progress(total, "file", desc, enabled=not self.no_progress)
