"""What `hsq run` starts on this node: which engine (reference, SGLang, vLLM), how many
servers, on which GPUs.

Pure functions of what was asked and what the machine has (`visible_gpus`,
`sglang_importable` read the machine; everything else is unit-tested without it).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hsq.engines.launch import read_local_config
from hsq.engines.reference.shapes import eagle3_default_layers, shape_config
from hsq.errors import ConfigError
from hsq.runconfig import ModelShape, RunConfig
from hsq.states import FP8
from hsq.workers.settings import SGLANG_API, VLLM_API

REFERENCE = "reference"
SGLANG = "sglang"
VLLM = "vllm"
NODE_ENGINES = (REFERENCE, SGLANG, VLLM)
"""`hsq run --engine`: the servers it can start (`hsq serve-reference`, `hsq launch-sglang`,
`hsq launch-vllm`)."""
ON_GPUS = {SGLANG: "SGLang", VLLM: "vLLM"}
"""The engines whose servers take GPUs, TP-sized groups of them (by name, for messages)."""
WORKER_API = {REFERENCE: SGLANG_API, SGLANG: SGLANG_API, VLLM: VLLM_API}
"""The API each engine's servers speak: `hsq worker --engine` of the worker beside one."""
TINY_MODEL = "tiny"
"""The reference server's built-in tiny Llama: no download, runs on CPU."""


@dataclass(frozen=True)
class ServerSpec:
    """One inference server and the worker that owns its dump dir."""

    index: int
    kind: str
    gpus: tuple[str, ...]
    """CUDA_VISIBLE_DEVICES of the server (empty: CPU)."""


@dataclass(frozen=True)
class NodePlan:
    kind: str
    model: str
    tp: int
    servers: tuple[ServerSpec, ...]
    why: str
    """How the kind was chosen, in words (shown at start)."""


def parse_gpus(text: str) -> tuple[str, ...]:
    """ "0-3,6" -> ("0", "1", "2", "3", "6"); "" -> (). Order kept, duplicates refused."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ConfigError(f"--gpus: {part!r} is not a GPU index or range (e.g. 0-7 or 0,2)")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ConfigError(f"--gpus: range {part!r} runs backwards")
        out += [str(i) for i in range(lo, hi + 1)]
    if len(set(out)) != len(out):
        raise ConfigError(f"--gpus {text!r} names a GPU twice")
    return tuple(out)


def visible_gpus(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> tuple[str, ...]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set (its entries as given,
    so UUIDs work too), else one per /dev/nvidiaN device."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return tuple(g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip())
    try:
        found = [p.name[6:] for p in dev.glob("nvidia[0-9]*") if p.name[6:].isdigit()]
    except OSError:
        return ()
    return tuple(sorted(found, key=int))


def sglang_importable() -> bool:
    return importlib.util.find_spec("sglang") is not None


def choose_kind(requested: str | None, *, sglang: bool, gpus: Sequence[str]) -> tuple[str, str]:
    """(kind, why): the one asked for, else SGLang where it can run, else the reference
    server on CPU."""
    if requested is not None:
        if requested not in NODE_ENGINES:
            raise ConfigError(f"--engine must be one of {', '.join(NODE_ENGINES)}")
        return requested, f"--engine {requested}"
    if sglang and gpus:
        return SGLANG, f"SGLang is importable and {len(gpus)} GPU(s) are visible"
    missing = "SGLang is not importable" if not sglang else "no GPU is visible"
    return REFERENCE, f"{missing}: the reference server on CPU"


def split_gpus(gpus: Sequence[str], tp: int, engine: str = "SGLang") -> list[tuple[str, ...]]:
    """Consecutive groups of `tp` GPUs, one per server; every GPU used exactly once."""
    if tp < 1:
        raise ConfigError("--tp must be >= 1")
    if not gpus:
        raise ConfigError(
            f"{engine} needs GPUs and none is visible: give --gpus, or --engine reference"
        )
    if len(gpus) % tp:
        raise ConfigError(
            f"{len(gpus)} GPU(s) do not split into servers of --tp {tp}: "
            f"give --gpus with a multiple of {tp} GPUs"
        )
    return [tuple(gpus[i : i + tp]) for i in range(0, len(gpus), tp)]


def plan_node(
    *,
    requested: str | None,
    model: str | None,
    gpus_flag: str | None,
    tp: int,
    servers: int | None,
    sglang: bool,
    visible: Sequence[str],
) -> NodePlan:
    """The servers to start. SGLang or vLLM: GPUs / TP servers (the GPUs of --gpus, default
    every visible one). Reference: --servers of them (default 1) on CPU, the tiny model
    unless --model."""
    gpus = parse_gpus(gpus_flag) if gpus_flag is not None else tuple(visible)
    kind, why = choose_kind(requested, sglang=sglang, gpus=gpus)
    if kind in ON_GPUS:
        name = ON_GPUS[kind]
        if model is None:
            raise ConfigError(f"--engine {kind} needs --model (the checkpoint {name} serves)")
        groups = split_gpus(gpus, tp, name)
        if servers is not None and servers != len(groups):
            raise ConfigError(
                f"--servers {servers} disagrees with {len(gpus)} GPU(s) / --tp {tp} = "
                f"{len(groups)}: {name} servers are GPUs / TP (choose them with --gpus)"
            )
        specs = tuple(ServerSpec(i, kind, g) for i, g in enumerate(groups))
        return NodePlan(kind, model, tp, specs, why)
    if gpus_flag is not None:
        raise ConfigError(f"--gpus is for SGLang and vLLM servers ({why})")
    if tp != 1:
        raise ConfigError(
            "--tp is for SGLang and vLLM servers; the reference server runs on one device"
        )
    n = 1 if servers is None else servers
    if n < 1:
        raise ConfigError("--servers must be >= 1")
    specs = tuple(ServerSpec(i, kind, ()) for i in range(n))
    return NodePlan(kind, model or TINY_MODEL, 1, specs, why)


def persist_procs_each(workers: int, cpus: int | None = None) -> int:
    """Persist processes per worker when the user gave none: the host's cores shared by the
    node's workers (hsq.workers.persist.procs.default_procs would give each worker half the
    host, 64 processes for 8 workers on 16 cores). Threads (0) below 4 cores a worker."""
    import os

    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = (cpus or 1) // max(1, workers)
    return 0 if share < 4 else min(8, share // 2)


def server_args_for(kind: str, cfg: RunConfig, server_args: Sequence[str]) -> list[str]:
    """The flags every server of the node gets, from what the run records (so a rerun or a
    --join that leaves them out still starts servers that make the run's dumps):
    - `--prenorm` for a run that stores the pre-norm state: a server without it refuses
      nothing and makes dumps the worker must reject.
    - `--layers` for a run whose layers are known, on the engines whose `--layers` speaks
      the run's convention (HF hidden_states indices: the reference server, vLLM); SGLang's
      launcher takes the drafter config's ids, which map per model family, so there the
      run's layers are checked against the dumps (and given after `--` when not SGLang's
      default).
    - an fp8 run's servers make the fp8 themselves (`--dump-encoding fp8-e4m3`, on the GPU
      for SGLang): half the bytes through the dump dir and no quantizing in the worker,
      whose short-sample rate it halved on the H200 (308 against 472 samples/s:
      BENCHMARKS.md 7c); the output files are the same bytes.
    Put first, so a flag the user gives after `--` wins (click keeps the last)."""
    lead = ["--dump-encoding", FP8] if cfg.store_dtype == FP8 else []
    if cfg.prenorm:
        lead.append("--prenorm")
    if cfg.layer_ids and kind in (REFERENCE, VLLM):
        lead += ["--layers", ",".join(str(i) for i in cfg.layer_ids)]
    return [*lead, *server_args]


def model_shape(plan: NodePlan, server_args: Sequence[str]) -> ModelShape | None:
    """What the node's servers will dump, read off the model before any starts: the hidden
    size and layer count of the checkpoint's config.json (its text config for a multimodal
    wrapper such as Kimi-K2.5's), or of the reference server's named shape, and the
    engines' default aux layers (EAGLE-3's three: every engine picks [2, L//2, L-3]) unless
    the servers are given `--layers` after `--`. None where it cannot be read (a hub id,
    no readable config): the spool's budget is then checked at the first dump."""
    path = Path(plan.model)
    if plan.kind == REFERENCE and not path.exists():
        try:
            config: dict[str, object] | None = shape_config(plan.model)
        except ConfigError:
            return None  # the server says what is wrong with --model
        source = f"the reference server's {plan.model} model"
    else:
        config = read_local_config(plan.model)
        source = f"{path / 'config.json'}"
        if config is not None and isinstance(config.get("text_config"), dict):
            config = config["text_config"]  # type: ignore[assignment]
    if config is None:
        return None
    hidden, layers = config.get("hidden_size"), config.get("num_hidden_layers")
    if not isinstance(hidden, int) or not isinstance(layers, int) or hidden < 1 or layers < 1:
        return None
    own = any(a == "--layers" or a.startswith("--layers=") for a in server_args)
    return ModelShape(hidden, None if own else eagle3_default_layers(layers), source)
