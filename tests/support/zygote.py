"""The zygote: a process that has imported torch, transformers and the reference server
once, and forks `python -m MODULE ARGS` children on request (fork without exec), so a
test session pays those imports (about 7 s of CPU) once instead of at every server start;
and hsq's worker and commands, whose start (about 0.6-0.9 s of CPU, mostly imports) the
tests pay hundreds of times.

Run by tests.support.spawner (the client side, which decides what may start here); not a
product command: `hsq run` and `hsq demo` start their servers fresh
(docs/reference-server.md, "Many servers in the tests").

Protocol, over the SOCK_SEQPACKET socket inherited as --fd: the zygote sends
{"ready": true, "pid": N} once its imports are done; each request is one JSON message
{"module", "args", "env", "cwd", "umask", "new_session", "pdeathsig"} carrying two or
three descriptors (SCM_RIGHTS): a status socket, then the child's log file (its stdout and
stderr both), or its stdout and its stderr apart. On the status socket
the zygote answers {"pid": N} (or {"error": ...}), then {"returncode": RC} (Popen's
convention: -N for a signal) once it has reaped the child. EOF on the control socket
(the client closed it, or died) ends the zygote.

The zygote runs no torch compute and starts no thread before it forks. The one foreign
thread in it is OpenBLAS's pool (numpy, imported by torch), which OpenBLAS's own
pthread_atfork handler stops before every fork.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from typing import Any

PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "hsq.engines.reference.app",
    "hsq.cli.main",
    "hsq.cli.commands.serve",
    "hsq.workers.worker",
    "hsq.cli.commands.admin",
    "hsq.cli.commands.export",
    "hsq.cli.commands.produce",
    "hsq.cli.commands.recover",
    "hsq.cli.commands.status",
    "hsq.cli.commands.verify",
)
"""What `hsq serve-reference`, `hsq worker` and the commands the tests run import (each
command's module imports the rest of its code when it runs), loaded before the first
fork. Imports only: none of these starts a thread or opens a connection at import."""
PRELOAD_NAMES = ("AutoConfig", "AutoModel", "LlamaConfig", "LlamaModel", "MODEL_MAPPING")
"""transformers' lazy attributes the reference model uses: each resolves a submodule."""
MAX_MESSAGE = 1 << 20
"""The largest request (argv and environment) a client may send."""
PR_SET_PDEATHSIG = 1


def preload(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        for attr in PRELOAD_NAMES:
            getattr(transformers, attr)


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the client closed its end: nobody waits for it
        sock.send(json.dumps(msg).encode(), socket.MSG_NOSIGNAL)


def _prctl(option: int, arg: int) -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


class Zygote:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.pid = os.getpid()
        self.children: dict[int, socket.socket] = {}
        """Each live child's status socket."""
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector = selectors.DefaultSelector()
        # What a fresh child of our parent would get for SIGINT: Python keeps an ignored
        # SIGINT ignored at start (a parent run in the background, nohup), else installs
        # KeyboardInterrupt. Taken before serve() ignores it for the zygote itself.
        self.child_sigint = signal.getsignal(signal.SIGINT)

    def serve(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the test session's to take
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # wakes the selector
        self.selector.register(self.control, selectors.EVENT_READ, "control")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        _send(self.control, {"ready": True, "pid": self.pid})
        while True:
            for key, _ in self.selector.select():
                if key.data == "wake":
                    self._drain_wakeups()
                elif not self._take_request():
                    return
            self._reap()

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sock = self.children.pop(pid, None)
            if sock is not None:
                _send(sock, {"returncode": os.waitstatus_to_exitcode(status)})
                sock.close()

    def _take_request(self) -> bool:
        """One request from the control socket; False at EOF (the client is gone)."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.control, MAX_MESSAGE, 3)
        except InterruptedError:
            return True
        if not data and not fds:
            return False
        if len(fds) not in (2, 3):
            for fd in fds:
                os.close(fd)
            return True  # no status socket to answer on: a broken client
        status = socket.socket(fileno=fds[0])
        out_fd, err_fd = fds[1], fds[-1]  # one log for both, or stdout and stderr apart
        try:
            request = json.loads(data)
            pid = os.fork()
        except Exception as exc:  # a bad request or a failed fork: this request fails
            _send(status, {"error": f"{type(exc).__name__}: {exc}"})
            status.close()
            for fd in fds[1:]:
                os.close(fd)
            return True
        if pid == 0:
            self._become(request, out_fd, err_fd)  # never returns
        for fd in fds[1:]:
            os.close(fd)
        self.children[pid] = status
        _send(status, {"pid": pid})
        return True

    def _become(self, request: dict[str, Any], out_fd: int, err_fd: int) -> None:
        """In the forked child: the state a fresh `python -m MODULE ARGS` would have, then
        run MODULE as __main__ and exit as the interpreter would."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, self.child_sigint)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            if request["new_session"]:
                os.setsid()
            if request["pdeathsig"] is not None:
                _prctl(PR_SET_PDEATHSIG, int(request["pdeathsig"]))
                if os.getppid() != self.pid:  # the zygote died before the prctl took
                    os.kill(os.getpid(), int(request["pdeathsig"]))
            self._own_descriptors(out_fd, err_fd)
            os.chdir(request["cwd"])
            os.umask(int(request["umask"]))
            os.environ.clear()
            os.environ.update(request["env"])
            _reseed()
            module, args = str(request["module"]), [str(a) for a in request["args"]]
            sys.argv = [module, *args]  # run_module puts the module's file in argv[0]
            sys.orig_argv = [sys.executable, "-m", module, *args]
            sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
            gc.enable()
            code = _run_as_main(module)
        except BaseException:
            traceback.print_exc()
        finally:
            _finish(code)

    def _own_descriptors(self, out_fd: int, err_fd: int) -> None:
        """stdin /dev/null, stdout and stderr the files given, every other descriptor
        closed (as Popen's close_fds leaves a child)."""
        self.selector.close()
        for sock in (self.control, *self.children.values()):
            sock.close()
        self.children.clear()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))


def _reseed() -> None:
    """A fresh process draws its RNG seeds from the OS; a fork inherits the zygote's.
    Python's `random` reseeds itself after a fork; torch's and numpy's do not."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _run_as_main(module: str) -> int:
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return _exit_code(exc)
    except KeyboardInterrupt:
        # CPython ends with SIGINT itself after an uncaught KeyboardInterrupt.
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _finish(code: int) -> None:
    """The interpreter's own shutdown, short of its teardown: wait for non-daemon threads,
    run the atexit functions, flush; then exit without returning into the zygote."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        _flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.support.zygote")
    parser.add_argument("--fd", type=int, required=True, help="the control socket")
    parser.add_argument(
        "--preload", default=",".join(PRELOAD), help="modules to import, comma-separated"
    )
    opts = parser.parse_args(argv)
    control = socket.socket(fileno=opts.fd)
    preload([m for m in opts.preload.split(",") if m])
    _flush()
    gc.collect()
    gc.freeze()  # the children share these pages: no collection writes to them
    gc.disable()  # each child enables its own
    Zygote(control).serve()


if __name__ == "__main__":
    main()
