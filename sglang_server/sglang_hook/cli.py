"""Helpers for `hsq launch-sglang`: the command that starts a dumping SGLang server, and
the checks of a running server's /server_info. Pure: no SGLang import, no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sglang_server.sglang_hook.compat import (
    PINNED_VERSIONS,
    plugin_supported,
    prefill_graph_off_flags,
)
from sglang_server.sglang_hook.config import HookConfig

LAUNCHER_MODULE = "sglang_server.sglang_hook.launch"
# Flags that break the one-writer, rows-in-batch-order assumptions of the hook.
_UNSUPPORTED_FLAGS = (
    "--enable-dp-attention",
    "--enable-layernorm-sp",
    "--enable-return-hidden-states",
)


def launch_command(
    model_path: str,
    dump_dir: Path | str,
    *,
    sglang_version: str,
    layer_ids: Sequence[int] | None = None,
    rid_prefix: str = "hsq-",
    host: str = "127.0.0.1",
    port: int = 30000,
    tp_size: int = 1,
    python: str = "python",
    prefill_cuda_graph: bool = False,
    overlap_schedule: bool = True,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv of a dumping SGLang server, environment included (``env K=V ... python ...``).

    0.5.11+ runs stock ``sglang.launch_server`` and relies on the installed plugin; older
    versions go through hsq's launcher. Prefill CUDA graphs are off unless asked for:
    whether aux capture survives graph replay was never observed here (docs/sglang.md).
    """
    problems = check_launch_args(extra_args)
    if problems:
        raise ValueError("; ".join(problems))
    cfg = HookConfig(
        dump_dir=Path(dump_dir),
        layer_ids=tuple(layer_ids) if layer_ids is not None else None,
        rid_prefix=rid_prefix,
    )
    env = [f"{k}={v}" for k, v in cfg.to_env().items()]
    module = "sglang.launch_server" if plugin_supported(sglang_version) else LAUNCHER_MODULE
    cmd = [
        "env",
        *env,
        python,
        "-m",
        module,
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--disable-radix-cache",
    ]
    if not prefill_cuda_graph:
        cmd += prefill_graph_off_flags(sglang_version)
    if not overlap_schedule:
        cmd.append("--disable-overlap-schedule")
    return cmd + list(extra_args)


def check_launch_args(argv: Sequence[str]) -> list[str]:
    """Problems in SGLang launch arguments (the launcher refuses to start on any)."""
    problems = [f"{f} is not supported by the dump hook" for f in _UNSUPPORTED_FLAGS if f in argv]
    for flag in ("--dp-size", "--dp", "--pp-size", "--pp"):
        if flag in argv:
            i = list(argv).index(flag)
            if i + 1 < len(argv) and argv[i + 1] != "1":
                problems.append(f"{flag} {argv[i + 1]}: one scheduler must own the dump dir")
    return problems


def check_server_info(info: Mapping[str, Any]) -> list[str]:
    """Problems in a dumping server's /server_info (empty: good to go)."""
    problems: list[str] = []
    if info.get("disable_radix_cache") is not True:
        problems.append(
            "radix cache is on: a cached prefix is not recomputed, so its states are never "
            "dumped (launch with --disable-radix-cache)"
        )
    chunk = info.get("chunked_prefill_size")
    if not isinstance(chunk, int):
        problems.append(f"chunked_prefill_size is {chunk!r}, expected an integer (-1 = off)")
    elif 0 < chunk < 1024:
        problems.append(
            f"chunked_prefill_size {chunk}: long prompts split into many chunks, each a "
            "separate forward and D2H copy; use >= 1024 or -1"
        )
    if int(info.get("dp_size") or 1) > 1 or info.get("enable_dp_attention"):
        problems.append(
            "data parallelism: one scheduler per dump dir is supported, and DP "
            "attention pads rows the plan does not know"
        )
    if int(info.get("pp_size") or 1) > 1:
        problems.append("pipeline parallelism is not supported (aux capture is per stage)")
    if info.get("enable_return_hidden_states"):
        problems.append(
            "--enable-return-hidden-states is on: not needed, and a request asking "
            "for it costs a .tolist() on the scheduler thread"
        )
    if info.get("speculative_algorithm"):
        problems.append(
            f"speculative decoding ({info['speculative_algorithm']}) is on: a "
            "draft model also runs the logits processor"
        )
    for key in ("disable_prefill_cuda_graph", "disable_piecewise_cuda_graph"):
        if info.get(key) is False:
            problems.append(
                f"{key} is false: prefill CUDA graphs are on, unverified with aux "
                "capture (launch with --" + key.replace("_", "-") + ")"
            )
    version = info.get("version")
    if version is not None and str(version) not in PINNED_VERSIONS:
        problems.append(f"sglang {version} is not a pinned version {list(PINNED_VERSIONS)}")
    return problems
