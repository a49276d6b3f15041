"""The census's sitecustomize: scripts/test_census.py copies this file as sitecustomize.py
into a temporary folder that it puts first on PYTHONPATH for one instrumented run, so every
Python process of the run loads it. At exit, each appends one JSON line to the file
HSQ_CENSUS names: its argv, its CPU (getrusage of itself), whether it is a fork (of the
test zygote, of pytest, ...) rather than a fresh exec, and the modules that say what it
was. Processes killed by a signal never reach exit and are missed: totals are lower bounds.

No import of hsq or of anything slow: it runs in every interpreter the suite starts."""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
import time

_PATH = os.environ.get("HSQ_CENSUS")
_state = {"pid": os.getpid(), "forked": False, "done": False, "t0": time.monotonic()}


def _forked() -> None:
    # A fork's getrusage(RUSAGE_SELF) starts at zero (Linux), so its CPU is its own.
    _state.update(pid=os.getpid(), forked=True, done=False, t0=time.monotonic())


def _record(how: str, code: object = None) -> None:
    if _PATH is None or _state["done"] or _state["pid"] != os.getpid():
        return
    _state["done"] = True
    ru = resource.getrusage(resource.RUSAGE_SELF)
    mods = sys.modules
    line = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "argv": [str(a) for a in sys.argv[:12]],
        "forked": _state["forked"],
        "exit": how,
        "code": code if isinstance(code, int) else None,
        "user": round(ru.ru_utime, 3),
        "sys": round(ru.ru_stime, 3),
        "wall": round(time.monotonic() - float(_state["t0"]), 3),  # type: ignore[arg-type]
        "pytest": "_pytest" in mods,
        "xdist": "xdist.remote" in mods or "xdist.worker" in mods,
        "zygote": "tests.support.zygote" in mods,
    }
    try:
        fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


if _PATH is not None:
    os.register_at_fork(after_in_child=_forked)
    atexit.register(_record, "atexit")
    _real_exit = os._exit

    def _exit(code: int) -> None:  # the worker, the null server and zygote forks end here
        _record("_exit", code)
        _real_exit(code)

    os._exit = _exit
