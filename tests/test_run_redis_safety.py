"""The private Redis of `hsq run` is safe by construction, and its state dir is checked.

- After a run ends, another local user (`runuser -u nobody`) listening where the run's
  Redis was gets nothing when the commands the run printed are run, and those commands
  work as printed (they start OUT's Redis for as long as they run, with a new password).
- A client never sends a password to a unix socket another user serves.
- OUT/.hsq made or owned by another user, writable by others, or holding a `lock` link
  is refused with one line; the link's target is untouched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hsq.errors import StoreError
from hsq.producer.synthetic import write_synthetic
from hsq.store import connect
from tests.helpers import hsq, wait_until
from tests.run_helpers import NO_REDIS, Node, no_node_left
from tests.support.listener import LISTENER, NOBODY

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="SO_PEERCRED, runuser"),
    pytest.mark.timeout(600),
    pytest.mark.usefixtures(no_node_left.__name__),
]


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (runuser -u nobody, chown)")


class Listener:
    """A socket server of user nobody that prints what each connection sent."""

    def __init__(self, tmp: Path, kind: str, where: str) -> None:
        self.out = tmp / f"listener-{kind}.out"
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(
                ["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", LISTENER, kind, where],
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd="/",
                start_new_session=True,  # runuser's child too: stop() ends the group
            )

    def ready(self) -> bool:
        return "listening" in self.out.read_text() or self.proc.poll() is not None

    def received(self) -> str:
        return self.out.read_text()

    def stop(self) -> None:
        # Killing runuser alone would leave nobody's python listening (it did: orphans
        # were found after the suite).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in NO_REDIS}


def test_after_a_run_the_printed_commands_work_and_leak_nothing_to_another_user(
    tmp_path: Path,
) -> None:
    _needs_root()
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 12, seed=5, min_len=4, max_len=24)
    out = tmp_path / "out"
    node = Node(tmp_path, "run", str(ds), "--out", str(out))
    url_file = out / ".hsq" / "redis-url"
    wait_until(url_file.exists, 120, interval=0.1)
    url = url_file.read_text().strip()
    conf = out / ".hsq" / "redis" / "auth.conf"
    password_then = conf.read_text()
    assert node.wait() == 0, node.output()

    # Another user takes over where the run's Redis was: its TCP port (an old URL file),
    # or its socket's path (refused: OUT/.hsq is the run user's, mode 700).
    tcp = re.match(r"redis://[^@]*@127\.0\.0\.1:(\d+)/", url)
    where = tcp.group(1) if tcp else url.split("@", 1)[1].split("?")[0]
    listener = Listener(tmp_path, "tcp" if tcp else "unix", where)
    try:
        wait_until(listener.ready, 30, interval=0.05)
        printed = node.output().split("\nnext\n", 1)[1].splitlines()
        commands = [ln.strip() for ln in printed if ln.strip().startswith("hsq ")]
        assert {c.split()[1] for c in commands} >= {"verify", "export"}, printed
        status = f"hsq status --run data --redis-url-file {url_file}"
        failed = []
        for command in [status, *commands]:
            argv = shlex.split(command.replace("EXPORT_DIR", str(tmp_path / "export")))
            res = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                                 timeout=300, env=_env(), stdin=subprocess.DEVNULL)  # fmt: skip
            if res.returncode != 0:
                failed.append((command, res.returncode, res.stderr[-500:]))
        received = listener.received()
    finally:
        listener.stop()
    assert "got" not in received, received  # no connection, no AUTH, no password
    assert not failed  # the printed commands work as printed
    assert not url_file.exists()  # nothing names a stopped Redis
    assert conf.read_text() != password_then  # a new password at every start
    assert sorted((tmp_path / "export").iterdir())  # the export wrote files


def test_a_unix_socket_another_user_serves_gets_nothing(tmp_path: Path) -> None:
    """A stale URL naming a socket in a place others can write (/tmp: the fallback for a
    long OUT path): the client checks who serves it before it sends the password."""
    _needs_root()
    d = Path(tempfile.mkdtemp(prefix="hsq-planted-"))
    os.chown(d, NOBODY, NOBODY)
    sock = d / "redis.sock"
    listener = Listener(tmp_path, "unix", str(sock))
    try:
        wait_until(listener.ready, 30, interval=0.05)
        with pytest.raises(StoreError, match="not by you or root"):
            connect(f"unix://:s3cret-pw@{sock}?db=0")
        received = listener.received()
    finally:
        listener.stop()
        subprocess.run(["rm", "-rf", str(d)], check=True)
    # The client connects to ask the kernel who serves the socket (SO_PEERCRED), then
    # closes: the listener may see that connection, but not one byte (not even HELLO).
    sent = [line[3:].strip() for line in received.splitlines() if line.startswith("got")]
    assert not any(sent), received


def _planted(tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    state = out / ".hsq"
    state.mkdir(parents=True)
    target = tmp_path / "root-owned"
    target.write_text("root's file\n")
    (state / "redis-password").write_text("plantedpassword\n")
    (state / "lock").symlink_to(target)
    return out, target


def _refused(out: Path) -> subprocess.CompletedProcess[str]:
    # --redis-only: the old code served OUT's Redis until stopped (timeout: not refused).
    try:
        return subprocess.run(
            [sys.executable, "-m", "hsq", "run", "--out", str(out), "--redis-only"],
            capture_output=True, text=True, timeout=30, env=_env(), stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("served a state dir it should have refused") from exc


def test_a_state_dir_of_another_user_is_refused_in_one_line(tmp_path: Path) -> None:
    _needs_root()
    out, target = _planted(tmp_path)
    for p in (out / ".hsq", out / ".hsq" / "redis-password"):
        os.chown(p, NOBODY, NOBODY)
    os.lchown(out / ".hsq" / "lock", NOBODY, NOBODY)
    res = _refused(out)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "belongs to nobody" in lines[0] and "rm -rf" in lines[0], lines
    assert target.read_text() == "root's file\n"
    assert not (out / ".hsq" / "redis").exists()
    assert os.lstat(out / ".hsq").st_uid == NOBODY


def test_a_lock_link_is_not_followed_and_a_shared_state_dir_is_refused(tmp_path: Path) -> None:
    out, target = _planted(tmp_path)
    res = _refused(out)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "symbolic link" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert target.read_text() == "root's file\n"
    (out / ".hsq" / "lock").unlink()
    os.chmod(out / ".hsq", 0o777)
    res = _refused(out)
    assert res.returncode == 2 and "writable by others" in res.stderr, res.stderr


def test_status_of_a_dir_that_never_ran_says_so(tmp_path: Path) -> None:
    (tmp_path / "out" / ".hsq").mkdir(parents=True, mode=0o700)
    res = hsq("status", "--run", "x", "--redis-url-file", str(tmp_path / "out/.hsq/redis-url"))
    assert res.returncode == 2 and "holds no Redis data" in res.stderr, res.stderr
