"""`hsq launch-vllm`: a stock vLLM server with hsq's dump connector."""

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
class LaunchVllmFlags:
    model_path: str = setting(help="the checkpoint vLLM serves (a local directory)")
    dump_dir: Path = setting(path="dir", help="the dump dir the worker owns (node-local tmpfs)")
    aux_layer_ids: tuple[int, ...] | None = setting(
        None,
        flag="--layers",
        parse=int_tuple_or_none,
        default_text="EAGLE-3's 2,L/2,L-3",
        help="aux layers in hsq's convention (HF hidden_states indices, below L)",
    )
    num_layers: int | None = setting(
        None, default_text="config.json's", help="the model's layer count (for a hub id)"
    )
    port: int = setting(8000, help="port to listen on")
    common: LaunchCommon = field(default_factory=LaunchCommon)
    served_model_name: str | None = setting(
        None, help="vLLM's --served-model-name (then give the worker --served-model)"
    )
    python: str = setting(
        sys.executable, default_text="this Python", help="the Python of vLLM's environment"
    )


@hsq_command("launch-vllm", context_settings=PASS_ON)
@settings_options(LaunchVllmFlags)
@click.pass_context
def launch_vllm(ctx: click.Context, /, **values: Any) -> None:
    """Start a stock vLLM server whose connector writes hsq dumps into the dump dir.

    Sets extract_hidden_states with the aux layers (plus the final layer), hsq's connector,
    --no-enable-prefix-caching and --enable-prompt-tokens-details; extra arguments go to
    vLLM unchanged, bar those that would give wrong dumps. Then execs vLLM. Run the worker
    with --engine vllm (docs/vllm.md). hsq's --log-level and --log-format go before
    the command here: after it, they are vLLM's.

    \b
    Example:
      hsq launch-vllm --model-path /models/llama-3-8b --dump-dir /dev/shm/hsq0 --layers 2,16,29
    """
    from hsq.engines.vllm.launch import run

    f = take(LaunchVllmFlags, values)
    sys.exit(
        run(
            model_path=f.model_path,
            dump_dir=f.dump_dir,
            layers=f.aux_layer_ids,
            num_layers=f.num_layers,
            port=f.port,
            served_model_name=f.served_model_name,
            python=f.python,
            common=f.common,
            extra=list(ctx.args),
            echo=click.echo,
        )
    )
