"""Start-up check: the server's dump hook is active, and captures what the run pins.

A server whose hook never loaded (SGLang swallows plugin errors, a server started
without SGLANG_HS_DUMP_DIR) answers every request and writes no dump: each sample would
time out with no_dump, one after another. The hook writes a readiness marker into the
dump dir once the model is loaded (hsq.dump.ready.ReadyMarker); the worker refuses to start
without it, so the mistake costs one clear error instead of a run of retries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from hsq.dump.ready import READY_FILE, ReadyMarker, read_ready
from hsq.errors import HookInactiveError
from hsq.runconfig import RunConfig
from hsq.states import FP8

log = structlog.get_logger("hsq.readiness")
DEFAULT_WAIT_S = 1800.0
"""How long a worker waits for a server that is still starting (a large checkpoint loads
for many minutes). A server that answers /health without a marker is refused at once."""


def check_marker(
    marker: ReadyMarker,
    *,
    layer_ids: Sequence[int] | None = None,
    model_id: str | None = None,
    store_dtype: str | None = None,
    prenorm: bool = False,
) -> None:
    """HookInactiveError when the marker contradicts what the run pins or stores."""
    if marker.encoding == FP8 and store_dtype not in (None, FP8):
        raise HookInactiveError(
            f"the server writes dumps quantized to {FP8} and the run stores {store_dtype}: "
            f"enqueue the run with --store-dtype {FP8}, or restart the server without "
            "--dump-encoding fp8-e4m3 (SGLang: SGLANG_HS_DUMP_ENCODING)"
        )
    if prenorm and not marker.prenorm:
        raise HookInactiveError(
            "the run stores the pre-norm final state (hsq enqueue --prenorm) and the server "
            "does not capture it: restart it with --prenorm (SGLang: SGLANG_HS_PRENORM=1)"
        )
    if layer_ids is not None and list(marker.layer_ids) != list(layer_ids):
        raise HookInactiveError(
            f"the server captures layers {list(marker.layer_ids)}, the run pins "
            f"{list(layer_ids)} (hsq enqueue --layers): relaunch the server with layer "
            "ids that map to the pinned list (docs/sglang.md, Layer ids)"
        )
    if model_id is not None and marker.model.model_id != model_id:
        raise HookInactiveError(
            f"the server runs model {marker.model.model_id}, the run pins {model_id}"
        )


VLLM_SERVER = "vllm"
"""The marker's `server` of hsq's vLLM connector (hsq.engines.vllm.writer.SERVER)."""


def check_engine(marker: ReadyMarker, engine: str, who: str = "worker") -> None:
    """A vLLM connector's marker needs the vLLM client and any other marker SGLang's API
    (`engine`, hsq.workers.settings.EngineApi): with the wrong one every request fails (a
    404 per sample) or is never dumped."""
    if (marker.server == VLLM_SERVER) != (engine == VLLM_SERVER):
        want = VLLM_SERVER if marker.server == VLLM_SERVER else "sglang"
        raise HookInactiveError(
            f"the server's dump hook is {marker.server!r} and the {who} speaks "
            f"{engine!r}: start the {who} with --engine {want}"
        )


def await_hook(
    dump_dir: Path,
    healthy: Callable[[], bool],
    *,
    layer_ids: Sequence[int] | None = None,
    model_id: str | None = None,
    store_dtype: str | None = None,
    prenorm: bool = False,
    timeout_s: float = DEFAULT_WAIT_S,
    stop: threading.Event | None = None,
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
) -> ReadyMarker | None:
    """The server's marker, checked; waits while the server is still starting.

    The marker is written before the server reports healthy (the reference server before
    it listens; SGLang's hook after the model loads, before warm-up), so a healthy server
    without one has no active hook. Returns None only when ``stop`` is set while waiting.
    """
    deadline = clock() + timeout_s
    logged = False
    while True:
        marker = read_ready(dump_dir)
        if marker is not None:
            check_marker(
                marker,
                layer_ids=layer_ids,
                model_id=model_id,
                store_dtype=store_dtype,
                prenorm=prenorm,
            )
            log.info(
                "hook_ready",
                server=marker.server,
                server_version=marker.server_version,
                hook_version=marker.hook_version,
                model_id=marker.model.model_id,
                layer_ids=list(marker.layer_ids),
                encoding=marker.encoding,
                prenorm=marker.prenorm,
            )
            return marker
        if healthy():
            # Once more: the server may have written it between the two looks.
            if read_ready(dump_dir) is None:
                raise HookInactiveError(
                    f"the server is up but {dump_dir / READY_FILE} does not exist: its dump "
                    "hook is not active (SGLANG_HS_DUMP_DIR unset or different from "
                    "--dump-dir, plugin not installed or it failed at load; see the "
                    "server log and docs/sglang.md)"
                )
            continue
        if clock() >= deadline:
            raise HookInactiveError(
                f"no dump hook marker in {dump_dir} after {timeout_s:.0f}s and the server "
                "is not healthy: is it starting, and does it dump to this directory?"
            )
        if not logged:
            log.info("waiting_for_hook", dump_dir=str(dump_dir), timeout_s=timeout_s)
            logged = True
        if stop is not None:
            if stop.wait(poll_s):
                return None
        else:
            time.sleep(poll_s)


def require_hook(
    dump_dir: Path, healthy: Callable[[], bool], cfg: RunConfig, stop: threading.Event
) -> ReadyMarker | None:
    """The worker's start-up call: await_hook against the layers and model the run pins."""
    return await_hook(
        dump_dir,
        healthy,
        layer_ids=cfg.layer_ids,
        model_id=cfg.model_id,
        store_dtype=cfg.store_dtype,
        prenorm=cfg.prenorm,
        stop=stop,
    )
