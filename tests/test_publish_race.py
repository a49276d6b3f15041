"""The last window in which a woken worker could replace a file another worker redid,
with real processes (redis-server, null-model servers over
HTTP, `hsq worker`, SIGSTOP and SIGCONT): a worker stopped exactly between its look
before the rename and the rename itself, while another worker redoes its reaped sample.

The stop point is exact without a hook in hsq: the stopped worker runs with a
sitecustomize (written by the test, on its PYTHONPATH) that wraps hsq.fsio's naming
functions so that the process SIGSTOPs itself right before it gives the sample's output
its name, after every check the worker makes before that."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from hsq.node.procs import ManagedProcess, hsq_command
from hsq.outputs.check import checksum_matches
from hsq.producer.synthetic import write_synthetic
from tests.helpers import children, enqueue, hsq, log_events, state, store, wait_until
from tests.support.procs import NullServer
from tests.support.spawner import installed

FAST = ["--heartbeat-interval", "0.5", "--reap-interval", "0.5"]
ROOT = Path(__file__).resolve().parent.parent

STOP_BEFORE_NAMING = """
import os, signal, threading
_target = os.environ.get("HSQ_TEST_STOP_BEFORE_NAMING")
if _target:
    import hsq.fsio as _fsio
    _done = []

    def _wrap(fn):
        def named(src, dst, *args, **kwargs):
            if os.path.basename(str(dst)) == _target and not _done:
                _done.append(1)
                # To this thread itself: a SIGSTOP to the process may be taken by another
                # thread while this one goes on into the rename.
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            return fn(src, dst, *args, **kwargs)
        return named

    for _name in ("rename_durably", "rename_noreplace"):
        if hasattr(_fsio, _name):
            setattr(_fsio, _name, _wrap(getattr(_fsio, _name)))
"""


def null_server(base: Path, *args: str) -> NullServer:
    return NullServer(base / "dumps", base / "server.log", args=["--max-tokens", "1024", *args])


def worker(
    run: str, srv: NullServer, redis_url: str, log: Path, *extra: str, env: dict[str, str]
) -> ManagedProcess:
    argv = hsq_command(
        "worker", "--run", run, "--server", srv.url, "--dump-dir", str(srv.dump_dir), *extra
    )
    # Its own process group: a SIGSTOP of the group stops its persist processes too.
    env = {"HSQ_REDIS_URL": redis_url, **env}
    return ManagedProcess(argv, log, env=env, new_session=True, spawner=installed())


@pytest.mark.realproc
@pytest.mark.timeout(500)
@pytest.mark.parametrize("procs", ["0", "1"])
def test_a_worker_stopped_between_its_look_and_its_rename_replaces_nothing(
    tmp_path: Path, redis_url: str, procs: str
) -> None:
    """Worker A has written and checked sample s000000's file and is stopped right before
    giving it its name (with persist processes: its child there, then A's whole group).
    Worker B reaps A's job, redoes the sample (other values: another server seed) and
    marks it done. A is continued and names its file. Before the fix A's rename replaced
    B's file while B's entry stayed marked: `verify --deep` found a checksum mismatch.
    Now A finds the name taken by a valid file, adopts it, and the marked entry is the
    file on disk, B's bytes."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_BEFORE_NAMING)
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 1, seed=5, min_len=200, max_len=200)
    out = tmp_path / "out"
    enqueue(ds, "win", out, redis_url)
    st = store(redis_url, "win")
    sa = null_server(tmp_path / "a", "--seed", "1")
    sb = null_server(tmp_path / "b", "--seed", "2")
    a = b = None
    env = {"HSQ_TEST_STOP_BEFORE_NAMING": "s000000.safetensors", "PYTHONPATH": f"{hook}:{ROOT}"}
    extra = [*FAST, "--burst", "--persist-procs", procs]
    try:
        sa.wait_ready()
        sb.wait_ready()
        a = worker("win", sa, redis_url, tmp_path / "a.log", *extra, env=env)
        pid = a.pid
        wait_until(lambda: any(state(p) == "T" for p in [pid, *children(pid)]), 120, 0.05)
        a.signal_group(signal.SIGSTOP)  # the rest of A too: its heartbeat stops
        assert not list(out.rglob("*.safetensors"))  # A's file has no name yet
        b = worker("win", sb, redis_url, tmp_path / "b.log", *extra, env={})
        assert b.proc.wait(240) == 0, b.log_tail()
        (sid, entry), *_ = list(st.iter_manifest())
        assert entry is not None
        path = out / "win" / entry.path
        assert checksum_matches(path, entry.checksum)
        b_bytes = path.read_bytes()
        a.signal_group(signal.SIGCONT)  # A names its file now
        assert a.proc.wait(120) == 0, a.log_tail()
    finally:
        for p in (a, b):
            if p is not None:
                p.signal_group(signal.SIGCONT)
                p.stop()
        sa.stop()
        sb.stop()
    assert sid == "s000000"
    assert path.read_bytes() == b_bytes and checksum_matches(path, entry.checksum)
    taken = log_events(tmp_path / "a.log", "sample_name_taken")
    assert [e["adopted"] for e in taken] == [1], a.log_tail()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left behind
    res = hsq("verify", "--run", "win", "--deep", "--redis", redis_url)
    assert res.returncode == 0, res.stdout + res.stderr
