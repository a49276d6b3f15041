"""Persist processes: the per-sample CPU work of the persist stage (validate, read, finite
check, checksum, quantize, write, fsync) in N child processes of the worker, so a worker is
not bound by one interpreter's GIL (BENCHMARKS.md has the measurement).

What stays in the worker's main process, single-owner: the dispatcher and rid matching, the
pins, the done look and lease check before a rename (the fence that keeps a woken worker
from replacing a sample another worker redid), and every Redis write.
A child writes its sample's temp file and fsyncs it, then asks its parent whether it may
rename (`before_rename`); only on "go" does the file take its name, and only after the
child answered the result does the parent hand the sample to the committer. So a child
killed anywhere leaves at most a temp file (named after its pid: the next write of that
sample removes it, hsq/fsio.py) or an unmarked file that the sample's redo replaces;
nothing is marked done that is not durably on disk. A dead child fails its sample with
PersistProcessError (retried without using an attempt) and is started again.

The wire between parent and child is a pipe of length-prefixed JSON frames (no pickle):
  parent -> child  {"job": WriteJob}            child -> parent  {"op": "rename?"}
  parent -> child  {"go": true|false}           child -> parent  {"op": "done", ...} |
                                                                 {"op": "refused"} |
                                                                 {"op": "error", ...}
Children ignore SIGINT and SIGTERM (the worker drains and closes them: EOF on stdin ends
a child) and exit when their parent's pipe closes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

import msgspec

from hsq.errors import PersistProcessError
from hsq.states import FP8
from hsq.workers.persist.work import (
    PersistChildError,
    WriteJob,
    decode_error,
    encode_error,
    frame,
)

MAX_FRAME = 64 << 20
"""A frame holds one sample's token ids and meta: far below this."""
_decode_frame = msgspec.json.Decoder().decode


def default_procs() -> int:
    """Persist processes by default: none (threads) on a machine of 1-3 cores, where the
    server and the worker share the cores anyway, else half the cores this process may run
    on, at most 8 (a node runs one worker per server on the same host)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    return 0 if cpus < 4 else min(8, cpus // 2)


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """One frame, or None at EOF (the other side is gone)."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    n = int.from_bytes(head, "big")
    if n > MAX_FRAME:
        raise PersistChildError(f"a frame of {n} bytes is over the {MAX_FRAME} limit")
    data = stream.read(n)
    if len(data) < n:
        return None
    try:
        obj = _decode_frame(data)
    except msgspec.MsgspecError as exc:
        raise PersistChildError(f"a frame that is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise PersistChildError("a frame that is not a JSON object")
    return obj


class _Refused(Exception):
    """The parent said no at the rename (done elsewhere, pins, lease): nothing is renamed."""


class _Child:
    """One persist process and its pipes; started again after it died."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True
            )
        return self.proc

    def _died(self, proc: subprocess.Popen[bytes]) -> PersistProcessError:
        with contextlib.suppress(OSError):
            proc.kill()
        rc = proc.wait()
        _close_pipes(proc)
        self.proc = None
        return PersistProcessError(f"persist process {proc.pid} died (exit {rc}) mid-sample")

    def call(
        self,
        job: WriteJob,
        before_rename: Callable[[], None],
        stats: dict[str, float],
    ) -> tuple[int, str]:
        proc = self._ensure()
        assert proc.stdin is not None and proc.stdout is not None
        verdict: BaseException | None = None
        try:
            proc.stdin.write(frame({"job": job.to_dict()}))
            proc.stdin.flush()
            while True:
                msg = read_frame(proc.stdout)
                if msg is None:
                    raise self._died(proc)
                op = msg.get("op")
                if op == "rename?":
                    try:
                        before_rename()
                    except BaseException as exc:  # raised again once the child answered
                        verdict = exc
                    proc.stdin.write(frame({"go": verdict is None}))
                    proc.stdin.flush()
                elif op == "done":
                    stats.update({str(k): float(v) for k, v in msg.get("stats", {}).items()})
                    return int(msg["bytes"]), str(msg["checksum"])
                elif op == "refused" and verdict is not None:
                    raise verdict
                elif op == "error":
                    raise decode_error(msg.get("error") or {})
                else:
                    raise PersistChildError(f"persist process sent {msg!r}")
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(proc) from None

    def warm(self, store_dtype: str) -> None:
        proc = self._ensure()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(frame({"warm": store_dtype}))
            proc.stdin.flush()
            if read_frame(proc.stdout) is None:
                self._died(proc)
        except OSError:
            self._died(proc)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the child exits
            proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        _close_pipes(proc)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


class PersistProcs:
    """N persist processes; each call takes a free one (a persist thread drives it)."""

    def __init__(self, n: int, *, direct_io: bool, torch_threads: int = 1) -> None:
        # -P: the current directory (a clone named hsq/ beside where `hsq run` started)
        # cannot shadow the installed package (hsq.node.procs.python_module says more).
        argv = [sys.executable, "-P", "-m", "hsq.workers.persist.procs"]
        argv += ["--direct-io", "1" if direct_io else "0", "--torch-threads", str(torch_threads)]
        self.children = [_Child(argv) for _ in range(max(1, n))]
        self._free: queue.Queue[_Child] = queue.Queue()
        for c in self.children:
            c._ensure()  # start them now: their imports overlap the worker's start-up
            self._free.put(c)

    def warm(self, store_dtype: str) -> None:
        """Have each child import what `store_dtype` needs (torch for fp8) now, in the
        background: the first samples do not pay a second of imports each."""

        def one(child: _Child) -> None:
            try:
                child.warm(store_dtype)
            finally:
                self._free.put(child)

        for _ in self.children:
            threading.Thread(target=one, args=(self._free.get(),), daemon=True).start()

    def pids(self) -> list[int]:
        return [p for c in self.children if (p := c.pid) is not None]

    def write(
        self, job: WriteJob, before_rename: Callable[[], None], stats: dict[str, float]
    ) -> tuple[int, str]:
        child = self._free.get()
        try:
            return child.call(job, before_rename, stats)
        finally:
            self._free.put(child)

    def close(self) -> None:
        for c in self.children:
            c.close()


# ---------------------------------------------------------------------- the child
class _Serve:
    """The child's side: read a job, do it, ask before the rename, answer."""

    def __init__(self, rd: IO[bytes], wr: IO[bytes], *, direct_io: bool, threads: int) -> None:
        from hsq.stfile.engine import WriteEngine

        self.rd, self.wr = rd, wr
        self.engine = WriteEngine(direct_io=direct_io)
        self.threads = threads
        self.torch_set = False

    def send(self, obj: dict[str, Any]) -> None:
        self.wr.write(frame(obj))
        self.wr.flush()

    def _torch(self, store_dtype: str) -> None:
        if store_dtype == FP8 and not self.torch_set:
            import torch

            torch.set_num_threads(self.threads)
            self.torch_set = True

    def _before_rename(self) -> None:
        self.send({"op": "rename?"})
        reply = read_frame(self.rd)
        if reply is None:  # the worker is gone: no rename (the temp is removed)
            raise SystemExit(0)
        if not reply.get("go"):
            raise _Refused

    def one(self, msg: dict[str, Any]) -> None:
        if "warm" in msg:
            import numpy  # noqa: F401

            self._torch(str(msg["warm"]))
            self.send({"op": "warm"})
            return
        job = WriteJob.from_dict(msg["job"])
        self._torch(job.store_dtype)
        stats: dict[str, float] = {}
        try:
            try:
                nbytes, checksum = job.run_here(self.engine, stats, self._before_rename)
            finally:
                # The staged dump is used up whatever happened (a retry asks the server
                # again). Removed here, before the answer: freeing ~9 MB of tmpfs pages cost
                # the worker's own process ~1.9 ms of CPU a short sample; the
                # worker's removal after the answer is then a no-op.
                shutil.rmtree(job.staged, ignore_errors=True)
        except _Refused:
            self.send({"op": "refused"})
        except Exception as exc:
            self.send({"op": "error", "error": encode_error(exc)})
        else:
            self.send({"op": "done", "bytes": nbytes, "checksum": checksum, "stats": stats})

    def loop(self) -> int:
        try:
            while (msg := read_frame(self.rd)) is not None:
                self.one(msg)
        except BrokenPipeError:
            pass
        finally:
            self.engine.close()
        return 0


def _child_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="hsq.workers.persist.procs")
    ap.add_argument("--direct-io", default="1")
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker drains, then closes our pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rd, wr = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the parent's pipe
    serve = _Serve(rd, wr, direct_io=args.direct_io == "1", threads=max(1, args.torch_threads))
    return serve.loop()


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
