"""`hsq launch-sglang`: start a dumping SGLang server as a child and check it once it is up.

The command comes from launch_args.launch_command (pure); this module is the I/O around it: find
the installed SGLang version, start the process, poll /health, read /server_info and the
hook's readiness marker, and stop the server if its settings would produce wrong dumps or
its hook is not active.
"""

from __future__ import annotations

import importlib.metadata
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from hsq.dump.ready import READY_FILE, ReadyMarker, read_ready
from hsq.engines.launch import LaunchCommon, prepare_dump_dir, read_local_config
from hsq.engines.sglang import compat
from hsq.engines.sglang.launch_args import (
    check_model_config,
    check_server_info,
    launch_command,
)
from hsq.errors import ConfigError, HookInactiveError

EXIT_BAD_SERVER = 2


def installed_sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            "sglang is not installed here; pass --sglang-version with "
            "--print-only to only print the command"
        ) from exc


def check_running(info: Any, dump_dir: Path) -> tuple[list[str], ReadyMarker | None]:
    """Problems of a healthy server (its /server_info, its hook's readiness marker), and
    the marker when there is one."""
    problems = (
        check_server_info(info) if isinstance(info, dict) else ["/server_info is not an object"]
    )
    try:
        marker = read_ready(dump_dir)
    except HookInactiveError as exc:
        return [*problems, str(exc)], None
    if marker is None:
        problems.append(
            f"no {READY_FILE} in {dump_dir}: the dump hook is not active in this server "
            "(plugin not installed, SGLANG_HS_DUMP_DIR not reaching it, or it failed: see "
            "the server log)"
        )
    return problems, marker


def local_config_problems(
    model_path: str, layers: tuple[int, ...] | None, version: str
) -> list[str]:
    """What a local checkpoint's config.json says against the settings (empty for a hub
    id or an unreadable config: the plugin checks again once SGLang has loaded it)."""
    config = read_local_config(model_path)
    if config is None:
        return []
    return check_model_config(
        config, layers, deepseek_first_id_rule=compat.deepseek_first_id_rule(version)
    )


def run_checked(
    *,
    model_path: str,
    dump_dir: Path,
    layers: tuple[int, ...] | None,
    port: int,
    sglang_version: str | None,
    start_timeout: float,
    common: LaunchCommon,
    extra: list[str],
    echo: Callable[[str], None],
) -> int:
    version = sglang_version or installed_sglang_version()
    try:
        cmd = launch_command(
            model_path,
            dump_dir,
            sglang_version=version,
            layer_ids=layers,
            host=common.host,
            port=port,
            tp_size=common.tp,
            python=sys.executable,
            encoding=common.dump_encoding,
            prenorm=common.prenorm,
            extra_args=extra,
        )
    except ValueError as exc:
        raise ConfigError(f"refusing to start SGLang: {exc}") from exc
    problems = local_config_problems(model_path, layers, version)
    if problems:
        raise ConfigError("refusing to start SGLang: " + "; ".join(problems))
    echo(shlex.join(cmd))
    if common.print_only:
        return 0
    prepare_dump_dir(dump_dir)
    proc = subprocess.Popen(cmd)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    host = common.host
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    deadline = time.monotonic() + start_timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(2)
    else:
        proc.terminate()
        echo(f"error: SGLang did not become healthy (exit {proc.poll()})")
        return EXIT_BAD_SERVER
    info = httpx.get(base + "/server_info", timeout=30).json()
    problems, marker = check_running(info, dump_dir)
    if problems or marker is None:
        for p in problems:
            echo(f"error: {p}")
        proc.terminate()
        proc.wait(120)
        return EXIT_BAD_SERVER
    echo(
        f"sglang {version} serving at {base}, dumping to {dump_dir}; /server_info and the "
        f"hook checked: model {marker.model.model_id}, layers "
        f"{','.join(map(str, marker.layer_ids))} (pin them: hsq enqueue --layers ...), "
        f"encoding {marker.encoding}, prenorm {'on' if marker.prenorm else 'off'}"
    )
    return proc.wait()
