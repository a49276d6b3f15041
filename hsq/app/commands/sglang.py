"""`hsq launch-sglang`: a stock SGLang server with the dump hook, checked before use."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from hsq.app.options import settings_options, take
from hsq.settings import int_tuple_or_none, setting
from hsq.states import ENCODINGS, PLAIN


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
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(30000, help="port to listen on")
    tp: int = setting(1, help="tensor parallel size (GPUs of one server)")
    sglang_version: str | None = setting(
        None,
        default_text="the installed one",
        help="decides plugin (>= 0.5.11) or launcher",
    )
    dump_encoding: str = setting(
        PLAIN,
        choices=ENCODINGS,
        help="fp8-e4m3: the GPU quantizes the states as fp8 outputs store them (for runs "
        "enqueued with --store-dtype fp8-e4m3)",
    )
    prenorm: bool = setting(False, help="also dump the final norm's input (runs with --prenorm)")
    print_only: bool = setting(False, help="print the command, start nothing")
    start_timeout_s: float = setting(1800.0, help="seconds SGLang may take to become healthy")


@click.command(
    "launch-sglang",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@settings_options(LaunchFlags)
@click.pass_context
def launch_sglang(ctx: click.Context, /, **values: Any) -> None:
    """Start a stock SGLang server that dumps hidden states, then check that it does.

    Sets the required flags (--disable-radix-cache, prefill CUDA graphs off) and the hook's
    environment; extra arguments go to SGLang unchanged. Once healthy, checks /server_info
    and the hook's readiness marker in the dump dir, and prints the effective layers to
    pin with `hsq enqueue --layers`. Exits 2 if the server's settings would produce wrong
    dumps or its hook is not active (docs/sglang.md).

    \b
    Example:
      hsq launch-sglang --model-path /models/kimi-k2.5 --tp 8 --dump-dir /dev/shm/hsq0
    """
    import shlex

    from hsq.sglang_server.sglang_hook.launch_sglang import run_checked

    f = take(LaunchFlags, values)
    sys.exit(
        run_checked(
            model_path=f.model_path,
            dump_dir=f.dump_dir,
            layers=f.aux_layer_ids,
            host=f.host,
            port=f.port,
            tp_size=f.tp,
            sglang_version=f.sglang_version,
            encoding=f.dump_encoding,
            prenorm=f.prenorm,
            extra=list(ctx.args),
            print_only=f.print_only,
            start_timeout=f.start_timeout_s,
            echo=click.echo,
            quote=shlex.join,
        )
    )
