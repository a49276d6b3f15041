"""`hsq launch-vllm`: build the command (launch_args.py), check it against the local
checkpoint, prepare the dump dir, then exec vLLM in this process (its signals, its exit
code). The worker then checks the connector's readiness marker before its first request."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

from hsq.engines.launch import LaunchCommon, prepare_dump_dir
from hsq.engines.vllm.launch_args import (
    config_problems,
    default_layer_ids,
    launch_command,
    read_local_config,
)
from hsq.errors import ConfigError


def plan(
    model_path: str, layers: Sequence[int] | None, num_layers: int | None
) -> tuple[tuple[int, ...], int]:
    """(the run's aux layers, the model's layer count), from the flags and config.json."""
    config = read_local_config(model_path)
    if config is not None and isinstance(config.get("num_hidden_layers"), int):
        found = int(config["num_hidden_layers"])
        if num_layers is not None and num_layers != found:
            raise ConfigError(f"--num-layers {num_layers}, but config.json has {found}")
        num_layers = found
    if num_layers is None:
        raise ConfigError(
            f"{model_path} has no readable config.json: pass --num-layers (and --layers)"
        )
    ids = tuple(layers) if layers else default_layer_ids(num_layers)
    problems = config_problems(config, ids) if config is not None else []
    if problems:
        raise ConfigError("refusing to start vLLM: " + "; ".join(problems))
    return ids, num_layers


def run(
    *,
    model_path: str,
    dump_dir: Path,
    layers: Sequence[int] | None,
    num_layers: int | None,
    port: int,
    served_model_name: str | None,
    python: str,
    common: LaunchCommon,
    extra: Sequence[str],
    echo: Callable[[str], None],
) -> int:
    ids, total = plan(model_path, layers, num_layers)
    try:
        cmd = launch_command(
            model_path,
            dump_dir,
            ids,
            total,
            host=common.host,
            port=port,
            tp_size=common.tp,
            served_model_name=served_model_name,
            encoding=common.dump_encoding,
            prenorm=common.prenorm,
            python=python,
            extra_args=extra,
        )
    except ValueError as exc:
        raise ConfigError(f"refusing to start vLLM: {exc}") from exc
    echo(shlex.join(cmd))
    echo(f"pin the layers with: hsq enqueue --layers {','.join(map(str, ids))}")
    if common.print_only:
        return 0
    prepare_dump_dir(dump_dir)
    os.execvp(cmd[0], cmd)
    return 1  # pragma: no cover - execvp does not return
