"""Redis across nodes: rediss:// with a CA and a client certificate, and
an ACL user with only the commands hsq needs. A real redis-server started with TLS and ACLs,
a self-signed CA made here with openssl, real hsq processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from hsq.cli.main import cli
from hsq.errors import StoreError
from hsq.node.procs import ManagedProcess, free_port
from hsq.producer.synthetic import write_synthetic
from hsq.redisurl import RedisTls
from hsq.store import connect
from tests.helpers import hsq, spawn_worker
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
ROOT = Path(__file__).resolve().parent.parent
# The ACL line docs/operations.md documents; the test reads it from there, so the two agree.
ACL_MARKER = "user hsq on"

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None or shutil.which("redis-server") is None,
    reason="needs openssl and redis-server",
)


def documented_acl() -> str:
    text = (ROOT / "docs/operations.md").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(ACL_MARKER)]
    assert len(lines) == 1, "docs/operations.md must hold exactly one `user hsq on ...` line"
    return lines[0]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "2", "-subj", "/CN=hsq-test-ca", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN=hsq-{name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext",
                cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(rediss:// URL of the ACL user hsq, the PKI directory); the default user is off."""
    d = tmp_path_factory.mktemp("tls")
    make_pki(d)
    port = free_port()
    acl = documented_acl().replace("<PASSWORD>", "hsq-pw")
    (d / "redis.conf").write_text(
        f"""port 0
tls-port {port}
bind 127.0.0.1
tls-cert-file {d}/server.crt
tls-key-file {d}/server.key
tls-ca-cert-file {d}/ca.crt
tls-auth-clients yes
dir {d}
save ""
appendonly no
user default on >admin-pw ~* &* +@all
{acl}
"""
    )
    srv = ManagedProcess(["redis-server", str(d / "redis.conf")], d / "redis.log")
    admin = redis.Redis(
        port=port, password="admin-pw", ssl=True, ssl_ca_certs=str(d / "ca.crt"),
        ssl_certfile=str(d / "client.crt"), ssl_keyfile=str(d / "client.key"),
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        try:
            admin.ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline or not srv.alive():
                srv.stop()
                pytest.fail(f"TLS redis-server did not start:\n{srv.log_tail()}")
            time.sleep(0.1)
    yield f"rediss://hsq:hsq-pw@127.0.0.1:{port}/0", d
    srv.stop()


def tls_env(d: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HSQ_REDIS_CA": str(d / "ca.crt"),
        "HSQ_REDIS_CERT": str(d / "client.crt"),
        "HSQ_REDIS_KEY": str(d / "client.key"),
    }


def test_a_whole_run_over_tls_as_the_least_privileged_acl_user(
    tmp_path: Path, tls_redis: tuple[str, Path], server_factory: Factory
) -> None:
    """Enqueue (TLS files as flags), a worker (as URL query parameters), status, verify and
    purge (as env vars), all as ACL user `hsq`; the same user cannot FLUSHALL or read keys
    outside hsq's, and a client without a certificate is refused."""
    url, d = tls_redis
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 12, seed=4, min_len=4, max_len=24)
    flags = ["--redis-ca", str(d / "ca.crt"), "--redis-cert", str(d / "client.crt"),
             "--redis-key", str(d / "client.key")]  # fmt: skip
    enq = hsq("enqueue", str(ds), "--run", "tls", "--out", str(tmp_path / "out"), "--redis",
              url, *flags, "--no-progress")  # fmt: skip
    assert enq.returncode == 0, enq.stderr

    server = server_factory(name="tlssrv").wait_ready()
    query = (f"?ssl_ca_certs={d}/ca.crt&ssl_certfile={d}/client.crt"
             f"&ssl_keyfile={d}/client.key")  # fmt: skip
    w = spawn_worker("tls", server.url, server.dump_dir, url + query, tmp_path / "w.log",
                       "--burst", "--name", "tls-w")  # fmt: skip
    assert w.proc.wait(180) == 0, w.log_tail()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return hsq(*args, "--redis", url, env=tls_env(d))

    st = cli("status", "--run", "tls", "--json")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["done"] == 12
    assert cli("verify", "--run", "tls", "--no-progress").returncode == 0
    assert cli("purge", "--run", "tls", "--yes").returncode == 0

    client = connect(url + query)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.get("someone-elses-key")
    with pytest.raises(StoreError):
        connect(url + f"?ssl_ca_certs={d}/ca.crt")  # no client certificate: refused


TLS_VARS = ("HSQ_REDIS_CA", "HSQ_REDIS_CERT", "HSQ_REDIS_KEY")


def test_tls_flags_travel_in_the_url_not_through_the_environment(
    tls_redis: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--redis-ca/--redis-cert/--redis-key were written into os.environ for
    connect() to read back (a process-wide side effect every later connect saw). They are
    values now: the command's URL carries them, and the environment is left alone."""
    url, d = tls_redis
    for var in TLS_VARS:
        monkeypatch.delenv(var, raising=False)
    flags = ["--redis-ca", str(d / "ca.crt"), "--redis-cert", str(d / "client.crt"),
             "--redis-key", str(d / "client.key")]  # fmt: skip
    res = CliRunner().invoke(cli, ["runs", "--redis", url, *flags], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert [var for var in TLS_VARS if var in os.environ] == []


def test_connect_reads_tls_files_from_the_url_alone(
    tls_redis: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment is the CLI's to read (click's envvar), not connect()'s."""
    url, d = tls_redis
    for var, name in zip(TLS_VARS, ("ca.crt", "client.crt", "client.key"), strict=True):
        monkeypatch.setenv(var, str(d / name))
    with pytest.raises(StoreError):
        connect(url)  # no files in the URL: nothing to verify the server with
    tls = RedisTls(str(d / "ca.crt"), str(d / "client.crt"), str(d / "client.key"))
    assert connect(tls.into_url(url)).ping()


def test_tls_files_join_the_query_of_a_rediss_url_only() -> None:
    tls = RedisTls(ssl_ca_certs="/etc/ca.pem", ssl_keyfile="/k dir/client.key")
    assert tls.into_url("rediss://u:p@h:6380/0") == (
        "rediss://u:p@h:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_keyfile=/k%20dir/client.key"
    )
    # a file the URL names wins; a plain redis:// or unix:// URL takes none
    assert tls.into_url("rediss://h:6380/0?ssl_ca_certs=/mine.pem") == (
        "rediss://h:6380/0?ssl_ca_certs=/mine.pem&ssl_keyfile=/k%20dir/client.key"
    )
    assert tls.into_url("redis://h:6379/0") == "redis://h:6379/0"
    assert RedisTls().into_url("rediss://h:6380/0") == "rediss://h:6380/0"
