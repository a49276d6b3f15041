"""Redis URLs carry a password: read them strictly, show them only redacted.

A password holding a reserved character (`/ ? # @ [ ]` ...) that is not percent-encoded
makes a URL mean something else: `redis://:pa/ss@host:6379/0` is host `` and port `pa` to
a URL parser, and the parser's own error ("Port could not be cast to integer value as
'pa'") or a connection error ("connecting to e:6379" for `s@e/cr3t`) would print part of
the password. So a URL is checked before anything parses it for real (`check_url`), the
error never quotes it, and `redact` hides everything between `://` and the LAST `@`, which
holds for any password, encoded or not.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from hsq.errors import ConfigError

SCHEMES = ("redis", "rediss", "unix")
SECRET_PARAMS = ("password", "username", "user")
MAX_URL_FILE_BYTES = 64 * 1024
_DB_PATH = re.compile(r"(/\d*)?")
_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENCODE_HINT = (
    "percent-encode the user name and password (e.g. `/` as %2F, `#` as %23, `?` as %3F, "
    "`@` as %40): python3 -c 'import getpass, urllib.parse; "
    'print(urllib.parse.quote(getpass.getpass(), safe=""))\''
)


def redact(url: str) -> str:
    """The URL without credentials: everything between `://` and the last `@` (a password
    may hold `@`, `/`, `?` or `#`), and any password=/username= query parameter."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>"  # could be a bare password pasted in the wrong place
    at = rest.rfind("@")
    if at >= 0:
        rest = "***@" + rest[at + 1 :]
    base, q, query = rest.partition("?")
    if q:
        params = []
        for kv in query.split("&"):
            key = kv.partition("=")[0]
            params.append(f"{key}=***" if key.lower() in SECRET_PARAMS else kv)
        rest = base + "?" + "&".join(params)
    return f"{scheme}://{rest}"


def check_url(url: str) -> None:
    """Raise ConfigError (quoting only the redacted URL) unless `url` reads unambiguously
    as redis[s]://[USER[:PASSWORD]@]HOST[:PORT][/DB][?k=v...] or unix://[...@]/PATH[?...]."""
    scheme, sep, _rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ConfigError(
            "the Redis URL must start with redis://, rediss:// or unix:// "
            "(redis://[USER]:PASSWORD@HOST:PORT/DB)"
        )
    bad = f"the Redis URL {redact(url)} is ambiguous; {ENCODE_HINT}"
    if "#" in url:
        raise ConfigError(bad)  # a Redis URL has no fragment: a `#` is a password's
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number)
    except ValueError:
        raise ConfigError(bad) from None
    if scheme.lower() == "unix":
        if "@" in parts.path:
            raise ConfigError(bad)
    elif not _DB_PATH.fullmatch(parts.path) or not parts.hostname:
        raise ConfigError(bad)
    for kv in filter(None, parts.query.split("&")):
        if not _PARAM.fullmatch(kv.partition("=")[0]):
            raise ConfigError(bad)


def secrets_of(url: str) -> list[str]:
    """The URL's user name and password, as written and decoded (to scrub them from
    messages of libraries that echo what they parsed)."""
    rest = url.partition("://")[2]
    at = rest.rfind("@")
    found: set[str] = set()
    if at >= 0:
        user, _, password = rest[:at].partition(":")
        found |= {user, password, unquote(user), unquote(password)}
    for kv in urlsplit(url).query.split("&") if "?" in url else []:
        key, _, value = kv.partition("=")
        if key.lower() in SECRET_PARAMS:
            found |= {value, unquote(value)}
    return sorted((s for s in found if s), key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` with every credential of `url` replaced by ***."""
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    return text


def read_url_file(path: Path) -> str:
    """The Redis URL from a file (a mode-600 file, a Docker or Kubernetes secret mounted
    with mode 0400): its first non-blank line. Errors never quote the file's content.

    A file that its group or other users may read or write is refused, as ssh refuses such
    a private key: the URL carries the Redis password, and a warning scrolls
    by in a job's log while every local user keeps reading the password."""
    try:
        with open(path, "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)  # the file opened, not the name
            if mode & 0o077:
                raise ConfigError(
                    f"--redis-url-file {path} has mode {mode:04o}: other users may read or "
                    f"change it, and it holds the Redis password; `chmod 600 {path}` (a "
                    "Docker or Kubernetes secret: mount it with mode 0400)"
                )
            data = f.read(MAX_URL_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read --redis-url-file {path}: {exc.strerror}") from None
    if len(data) > MAX_URL_FILE_BYTES:
        raise ConfigError(f"--redis-url-file {path} is larger than {MAX_URL_FILE_BYTES} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"--redis-url-file {path} is not UTF-8 text") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ConfigError(f"--redis-url-file {path} is empty")
    return lines[0]


@dataclass(frozen=True)
class RedisTls:
    """The TLS files of a rediss:// connection, built at the edge (the CLI's --redis-ca,
    --redis-cert, --redis-key or their HSQ_REDIS_* variables) and handed on as values: in
    the URL's query, the one place connect() reads them (no environment variable)."""

    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def into_url(self, url: str) -> str:
        """`url` with these files as query parameters; one the URL already gives wins.
        Only a rediss:// URL takes them (TLS means nothing to redis:// or unix://)."""
        if not url.startswith("rediss://"):
            return url
        _, q, query = url.partition("?")
        given = {kv.partition("=")[0] for kv in query.split("&")}
        extra = [
            f"{name}={quote(value, safe='/')}"
            for name, value in asdict(self).items()
            if value and name not in given
        ]
        if not extra:
            return url
        return url + ("&" if q else "?") + "&".join(extra)
