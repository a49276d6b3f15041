"""A child for tests/test_zygote.py: `python -m zygote_probe MODE [ARG]` (run from tests/).

state FILE   write what a process inherits (argv, env, cwd, descriptors, signals, RNG
             seeds, ...) to FILE as JSON, then exit 0
exit N       exit with status N
raise        raise an uncaught exception (the interpreter's exit 1 and traceback)
speak N      write lines to stdout and to stderr (a CRLF and a non-ASCII character among
             them), what stdin holds to stdout, then exit with status N
sleep        print "sleeping" and wait for a signal
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import sys
from typing import Any

PR_GET_PDEATHSIG = 2


def _handler_name(h: object) -> str:
    if h is signal.SIG_DFL:
        return "default"
    if h is signal.SIG_IGN:
        return "ignore"
    if h is signal.default_int_handler:
        return "KeyboardInterrupt"
    return "none" if h is None else "a handler"


def _status_masks() -> dict[str, str]:
    """The kernel's view of the dispositions (SigIgn, SigCgt: also handlers set from C)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigIgn", "SigCgt", "SigBlk"):
                out[key] = value.strip()
    return out


def state() -> dict[str, Any]:
    fds = []
    for fd in range(1024):
        try:
            os.fstat(fd)
        except OSError:
            continue
        fds.append(fd)
    pdeath = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(PR_GET_PDEATHSIG, ctypes.byref(pdeath), 0, 0, 0)
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    main = sys.modules["__main__"]
    return {
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "executable": sys.executable,
        "main_file": getattr(main, "__file__", None),
        "name": __name__,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": os.umask(os.umask(0)),
        "fds": fds,
        "std": [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)],
        "signals": {
            signal.Signals(s).name: _handler_name(signal.getsignal(s))
            for s in sorted(signal.valid_signals())
            if s not in (signal.SIGKILL, signal.SIGSTOP) and s in signal.Signals._value2member_map_
        },
        "caught_ignored": _status_masks(),
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "threads": len(os.listdir("/proc/self/task")),
        "pdeathsig": pdeath.value,
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "random": random.random(),
        "torch_seed": torch.initial_seed() if torch is not None else None,
        "numpy_random": float(np.random.random()) if np is not None else None,
    }


def main() -> None:
    mode = sys.argv[1]
    if mode == "state":
        seen = state()  # before this file is open
        with open(sys.argv[2], "w") as f:
            json.dump(seen, f)
    elif mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "speak":
        print("out: one\r\nout: two \u00e9")
        print("err: one", file=sys.stderr)
        print(f"stdin: {sys.stdin.read()!r}")
        print("err: two", file=sys.stderr)
        sys.exit(int(sys.argv[2]))
    elif mode == "raise":
        raise RuntimeError("the probe raised")
    elif mode == "sleep":
        print("sleeping", flush=True)
        while True:
            signal.pause()
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
