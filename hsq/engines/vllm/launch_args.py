"""The command line of a dumping vLLM server (`hsq launch-vllm`). Pure: no vLLM import,
no I/O but reading a local checkpoint's config.json."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hsq.engines.launch import read_local_config as read_config_json
from hsq.engines.vllm.config import ConnectorConfig
from hsq.engines.vllm.layers import layer_problems, vllm_aux_ids
from hsq.engines.vllm.refusals import ACCEPTED_CACHE_DTYPES
from hsq.states import PLAIN

CONNECTOR_MODULE = "hsq.engines.vllm.connector"
CONNECTOR_CLASS = "HsqConnector"
ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""extract_hidden_states runs on the V1 model runner only (vllm/config/vllm.py:2154-2165
falls back anyway; explicit is safer)."""
_OWN_FLAGS = (
    "--speculative-config",
    "--kv-transfer-config",
    "--enable-prefix-caching",
    "--tensor-parallel-size",
    "-tp",
)
"""Flags hsq sets itself (or refuses): given again, vLLM would take the later one."""
_VALUED_FLAGS: dict[str, tuple[str, ...]] = {
    "--kv-cache-dtype": ACCEPTED_CACHE_DTYPES,
    "--pipeline-parallel-size": ("1",),
    "-pp": ("1",),
    "--data-parallel-size": ("1",),
    "-dp": ("1",),
    "--prefill-context-parallel-size": ("1",),
    "--decode-context-parallel-size": ("1",),
}


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default aux layers, as vLLM's models and SpecForge pick them."""
    return (2, num_layers // 2, num_layers - 3)


def read_local_config(model_path: str) -> dict[str, Any] | None:
    """A local checkpoint's config.json (its text config for a multimodal wrapper); None
    for a hub id or an unreadable file (the connector checks again in vLLM)."""
    config = read_config_json(model_path)
    text = config.get("text_config") if config is not None else None
    if config is not None and isinstance(text, dict):
        return {**text, "architectures": config.get("architectures")}
    return config


def config_problems(config: Mapping[str, Any], layer_ids: Sequence[int]) -> list[str]:
    archs = config.get("architectures") or ["unknown"]
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int):
        return ["config.json has no num_hidden_layers"]
    return layer_problems(layer_ids, layers, str(archs[0]))


def check_extra_args(extra: Sequence[str]) -> list[str]:
    """Problems of the arguments passed through to vLLM."""
    problems = []
    for i, arg in enumerate(extra):
        name, eq, inline = arg.partition("=")
        if name in _OWN_FLAGS:
            problems.append(f"{name} is set by hsq launch-vllm (use its own options)")
        elif name in _VALUED_FLAGS:
            value = inline if eq else (extra[i + 1] if i + 1 < len(extra) else "")
            if value not in _VALUED_FLAGS[name]:
                problems.append(f"{name} {value}: only {', '.join(_VALUED_FLAGS[name])}")
    return problems


def launch_command(
    model_path: str,
    dump_dir: Path | str,
    layer_ids: Sequence[int],
    num_layers: int,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    tp_size: int = 1,
    served_model_name: str | None = None,
    encoding: str = PLAIN,
    prenorm: bool = False,
    python: str = "python",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv of a dumping vLLM server, environment included (``env K=V ... python ...``).
    ValueError when the arguments would give wrong or partial dumps."""
    problems = check_extra_args(extra_args)
    if tp_size < 1:
        problems.append(f"--tp {tp_size}: must be >= 1")
    if problems:
        raise ValueError("; ".join(problems))
    cfg = ConnectorConfig(
        dump_dir=Path(dump_dir), layer_ids=tuple(layer_ids), encoding=encoding, prenorm=prenorm
    )
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_aux_ids(layer_ids, num_layers)}
        },
    }
    kv = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": cfg.to_extra(),
    }
    cmd = ["env", *(f"{k}={v}" for k, v in ENV.items())]
    cmd += [python, "-m", "vllm.entrypoints.cli.main", "serve", model_path]
    cmd += ["--host", host, "--port", str(port), "--tensor-parallel-size", str(tp_size)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    cmd += [
        "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--speculative-config",
        json.dumps(spec, separators=(",", ":")),
        "--kv-transfer-config",
        json.dumps(kv, separators=(",", ":")),
        *extra_args,
    ]
    return cmd
