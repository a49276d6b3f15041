"""What a long sample costs the node while `hsq run` extracts it: the worker's resident
memory (the worker alone and with its persist processes) and the dump dir's bytes on its
tmpfs, sampled every POLL_S by a thread, then cut into one window per sample by the
worker's own `sample_done` events (the run sends one sample at a time: --inflight 1).

Reading /proc and the dump dir is all this does; `per_sample` (the windows) is pure and
tests/test_live_long.py checks it on a CPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

POLL_S = 0.05


@dataclass(frozen=True)
class Point:
    t: float
    """time.time() of the reading (the worker's log timestamps are wall-clock too)."""
    worker_rss: int
    """Bytes resident in the worker process (VmRSS), 0 while there is none."""
    tree_rss: int
    """The worker and every process under it (its persist processes)."""
    dump_bytes: int
    """Bytes allocated under the run's dump dirs (st_blocks: what tmpfs holds)."""
    shm_used: int
    """The dump dirs' filesystem, used bytes (every process's files on it)."""


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def rss_bytes(pid: int, key: str = "VmRSS") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def find_worker(run: str) -> int | None:
    """The `hsq worker --run RUN` process, if one is running."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "worker" in words and "--run" in words:
            i = words.index("--run")
            if i + 1 < len(words) and words[i + 1] == run:
                return int(name)
    return None


def dir_bytes(paths: Sequence[Path]) -> int:
    total = 0
    for root in paths:
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                with contextlib.suppress(OSError):  # removed by the worker meanwhile
                    total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


@dataclass
class Watch:
    """Samples the run's worker and dump dirs until stopped (a context manager)."""

    run: str
    dump_dirs: Callable[[], list[Path]]
    """The run's dump dirs as they exist now (hsq run makes them when it starts)."""
    shm: Path
    points: list[Point] = field(default_factory=list)
    worker_hwm: int = 0
    """The worker's own VmHWM (its lifetime peak), last read."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._loop, name="long-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        pid: int | None = None
        while not self._stop.is_set():
            if pid is None or not Path(f"/proc/{pid}").exists():
                pid = find_worker(self.run)
            w = tree = 0
            if pid is not None:
                w = rss_bytes(pid)
                tree = sum(rss_bytes(p) for p in descendants(pid))
                self.worker_hwm = max(self.worker_hwm, rss_bytes(pid, "VmHWM"))
            try:
                st = os.statvfs(self.shm)
                used = (st.f_blocks - st.f_bfree) * st.f_frsize
            except OSError:
                used = 0
            self.points.append(Point(time.time(), w, tree, dir_bytes(self.dump_dirs()), used))
            self._stop.wait(POLL_S)


def done_times(events: Sequence[dict[str, Any]]) -> list[tuple[str, float]]:
    """(sample, wall-clock time) of each sample_done event, in log order."""
    out = []
    for e in events:
        ts = datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()
        out.append((str(e["sample"]), ts))
    return out


def per_sample(
    done: Sequence[tuple[str, float]], points: Sequence[Point], start: float
) -> dict[str, dict[str, int]]:
    """Peaks of each window (previous sample's done, this sample's done], the first from
    `start`; one sample at a time, so a window is that sample's extraction and persist."""
    out: dict[str, dict[str, int]] = {}
    lo = start
    for sid, hi in done:
        inside = [p for p in points if lo < p.t <= hi]
        out[sid] = {
            "readings": len(inside),
            "worker_rss_peak": max((p.worker_rss for p in inside), default=0),
            "worker_tree_rss_peak": max((p.tree_rss for p in inside), default=0),
            "dump_dir_peak": max((p.dump_bytes for p in inside), default=0),
            "shm_used_peak": max((p.shm_used for p in inside), default=0),
        }
        lo = hi
    return out


def dump_bytes_per_token(hidden: int, aux_layers: int, *, prenorm: bool, fp8: bool) -> int:
    """The tensors of one token in a dump or a bf16 output (docs/outputs.md's formula):
    aux + last (+ pre-norm) states of `hidden` values, 2 bytes each in bf16; fp8: 1 byte
    and a float32 scale per state row."""
    states = aux_layers + 1 + int(prenorm)
    return states * (hidden + 4) if fp8 else states * hidden * 2
