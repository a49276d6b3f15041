"""`hsq launch-sglang`: a stock SGLang server with the dump hook, checked before use."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from hsq.cli.command import hsq_command
from hsq.cli.commands.launch import PASS_ON
from hsq.cli.options import settings_options, take
from hsq.engines.launch import LaunchCommon
from hsq.settings import int_tuple_or_none, setting


@dataclass(frozen=True)
class LaunchFlags:
    model_path: str = setting(help="the checkpoint SGLang serves")
    dump_dir: Path = setting(
        path="dir",
        env=("SGLANG_HS_DUMP_DIR",),
        help="the dump dir the worker owns (node-local tmpfs)",
    )
    aux_layer_ids: tuple[int, ...] | None = setting(
        None,
        flag="--layers",
        parse=int_tuple_or_none,
        default_text="SGLang's",
        help="EAGLE-3 aux layer ids as the drafter config names them",
    )
    port: int = setting(30000, help="port to listen on")
    common: LaunchCommon = field(default_factory=LaunchCommon)
    sglang_version: str | None = setting(
        None,
        default_text="the installed one",
        help="decides plugin (>= 0.5.11) or launcher",
    )
    start_timeout_s: float = setting(1800.0, help="seconds SGLang may take to become healthy")


@hsq_command("launch-sglang", context_settings=PASS_ON)
@settings_options(LaunchFlags)
@click.pass_context
def launch_sglang(ctx: click.Context, /, **values: Any) -> None:
    """Start a stock SGLang server that dumps hidden states, then check that it does.

    Sets the required flags (--disable-radix-cache, prefill CUDA graphs off) and the hook's
    environment; extra arguments go to SGLang unchanged. Once healthy, checks /server_info
    and the hook's readiness marker in the dump dir, and prints the effective layers to
    pin with `hsq enqueue --layers`. Exits 2 if the server's settings would produce wrong
    dumps or its hook is not active (docs/sglang.md). hsq's --log-level and --log-format
    go before the command here (`hsq --log-format console launch-sglang ...`): after it,
    they are SGLang's.

    \b
    Example:
      hsq launch-sglang --model-path /models/kimi-k2.5 --tp 8 --dump-dir /dev/shm/hsq0
    """
    from hsq.engines.sglang.launch_sglang import run_checked

    f = take(LaunchFlags, values)
    sys.exit(
        run_checked(
            model_path=f.model_path,
            dump_dir=f.dump_dir,
            layers=f.aux_layer_ids,
            port=f.port,
            sglang_version=f.sglang_version,
            start_timeout=f.start_timeout_s,
            common=f.common,
            extra=list(ctx.args),
            echo=click.echo,
        )
    )
