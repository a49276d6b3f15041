"""A live SGLang server as a managed child: the GPU tests (tests/gpu/) and the capacity
benchmark (bench/sglang_capacity.py) start it the same way.

With the hook, through `hsq launch-sglang` (the plugin via its entry point, the launcher's
checks, the readiness marker); without it, stock `python -m sglang.launch_server` (the
plugin is installed but inactive without SGLANG_HS_DUMP_DIR). Each server leads its own
process group, so a SIGKILL reaches SGLang's scheduler and detokenizer children too.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from hsq.errors import HsqError
from hsq.node.procs import ManagedProcess, hsq_command, low_port

# What the lent H200's offline bundle can run (docs/sglang.md, "Run live"): no FA3, no
# FlashMLA, no flashinfer cubins, no grammar backends, no tokenizer (token ids in).
SGLANG_FLAGS: tuple[str, ...] = (
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--skip-tokenizer-init",
    "--cuda-graph-backend-decode",
    "disabled",
    "--log-level",
    "info",
)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(
    pred: Callable[[], bool],
    timeout: float,
    what: str,
    proc: ManagedProcess | None = None,
    poll: float = 0.25,
) -> float:
    """Seconds until `pred()` holds; an error naming `what` (and the log's tail) if `proc`
    exits first or `timeout` passes."""
    t = time.monotonic()
    while not pred():
        if proc is not None and not proc.alive():
            raise HsqError(
                f"{what}: {proc.argv[:6]} exited {proc.proc.returncode}\n{proc.log_tail(60)}"
            )
        if time.monotonic() - t > timeout:
            tail = f"\n{proc.log_tail(60)}" if proc is not None else ""
            raise HsqError(f"{what}: not within {timeout:.0f}s{tail}")
        time.sleep(poll)
    return time.monotonic() - t


class SGLangServer:
    """One SGLang server on a free low port. `start` may be called again after `kill`
    (a restart on the same port, dump dir and log)."""

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        dump_dir: Path | None,
        layers: str | None = None,
        flags: Sequence[str] = (),
        tp: int = 1,
        env: dict[str, str] | None = None,
        start_timeout: float = 600.0,
    ) -> None:
        if tp < 1:
            raise HsqError(f"tp {tp}: expected >= 1")
        self.model, self.log, self.dump_dir = model, log, dump_dir
        self.layers, self.flags, self.tp = layers, list(flags), tp
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.port = low_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: ManagedProcess | None = None
        self.starts = 0

    @property
    def hooked(self) -> bool:
        return self.dump_dir is not None

    def argv(self) -> list[str]:
        if self.dump_dir is None:
            return [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                str(self.model),
                "--port",
                str(self.port),
                "--tp-size",
                str(self.tp),
                "--disable-radix-cache",
                "--disable-prefill-cuda-graph",
                *self.flags,
            ]
        layers = ["--layers", self.layers] if self.layers else []
        return hsq_command(
            "launch-sglang",
            "--model-path",
            str(self.model),
            "--dump-dir",
            str(self.dump_dir),
            "--port",
            str(self.port),
            "--tp",
            str(self.tp),
            "--start-timeout",
            str(int(self.start_timeout)),
            *layers,
            *self.flags,
        )

    def start(self) -> float:
        """Seconds until healthy (and, with the hook, until `hsq launch-sglang` said its
        checks passed)."""
        t = time.monotonic()
        self.starts += 1
        proc = self.proc = ManagedProcess(self.argv(), self.log, self.env, new_session=True)
        wait_for(lambda: healthy(self.url), self.start_timeout, "sglang health", proc)
        if self.hooked:
            wait_for(lambda: "serving at" in self.log_text(), 120, "launch-sglang checks", proc)
        return time.monotonic() - t

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL to the whole process group (launcher, SGLang, its schedulers)."""
        if self.proc is None:
            raise HsqError("kill: the server was never started")
        self.proc.signal_group(signal.SIGKILL)
        self.proc.proc.wait(60)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=30)
