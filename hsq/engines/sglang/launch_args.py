"""Helpers for `hsq launch-sglang`: the command that starts a dumping SGLang server, and
the checks of a running server's /server_info. Pure: no SGLang import, no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hsq.engines.sglang.compat import (
    PINNED_VERSIONS,
    plugin_supported,
    prefill_graph_off_flags,
)
from hsq.engines.sglang.config import HookConfig
from hsq.engines.sglang.layers import effective_layer_ids, family
from hsq.states import PLAIN

MIN_CHUNKED_PREFILL = 1024
"""Smallest --chunked-prefill-size accepted (-1 = off): each chunk is a forward and a copy."""

LAUNCHER_MODULE = "hsq.engines.sglang.legacy_launch"
# Flags that break the one-writer, rows-in-batch-order assumptions of the hook.
_UNSUPPORTED_FLAGS = (
    "--enable-dp-attention",
    "--enable-layernorm-sp",
    "--enable-return-hidden-states",
    "--enable-two-batch-overlap",
    "--enable-prefill-cp",
)
# Flags with a value: only these values are supported (the plugin checks the resolved
# settings again, whatever form the flag took).
_VALUED_FLAGS: dict[str, tuple[str, ...]] = {
    "--dp-size": ("1",),
    "--dp": ("1",),
    "--pp-size": ("1",),
    "--pp": ("1",),
    "--attn-dp-size": ("1",),
    "--attention-data-parallel-size": ("1",),
    "--attn-cp-size": ("1",),
    "--attention-context-parallel-size": ("1",),
    "--moe-a2a-backend": ("none",),
    "--cuda-graph-backend-prefill": ("disabled",),
}


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
    encoding: str = PLAIN,
    prenorm: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv of a dumping SGLang server, environment included (``env K=V ... python ...``).

    0.5.11+ runs stock ``sglang.launch_server`` and relies on the installed plugin; older
    versions go through hsq's launcher. Prefill CUDA graphs are off unless asked for:
    whether aux capture survives graph replay was never observed here (docs/sglang.md).
    """
    problems = tp_problems(tp_size, extra_args) + check_launch_args(extra_args)
    if problems:
        raise ValueError("; ".join(problems))
    cfg = HookConfig(
        dump_dir=Path(dump_dir),
        layer_ids=tuple(layer_ids) if layer_ids is not None else None,
        rid_prefix=rid_prefix,
        encoding=encoding,
        prenorm=prenorm,
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


TP_FLAGS = ("--tp-size", "--tensor-parallel-size")
"""SGLang's spellings of the tensor-parallel size; hsq passes it itself (`--tp N`)."""


def tp_problems(tp_size: object, extra_args: Sequence[str] = ()) -> list[str]:
    """The tensor-parallel size is hsq's `--tp N` (an integer >= 1), given once: a second
    value among the SGLang arguments would silently win (argparse keeps the last)."""
    out: list[str] = []
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        out.append(f"--tp {tp_size!r}: expected an integer >= 1")
    given = sorted({a.split("=", 1)[0] for a in extra_args if a.split("=", 1)[0] in TP_FLAGS})
    out += [f"{f} among the SGLang arguments: give the tensor-parallel size once, as --tp N"
            for f in given]  # fmt: skip
    return out


def _flag_values(argv: Sequence[str]) -> dict[str, str]:
    """`--flag value` and `--flag=value` pairs (the last one wins, as in argparse)."""
    out: dict[str, str] = {}
    args = list(argv)
    for i, a in enumerate(args):
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out[k] = v
        elif a.startswith("--") and i + 1 < len(args):
            out[a] = args[i + 1]
    return out


def check_launch_args(argv: Sequence[str]) -> list[str]:
    """Problems in SGLang launch arguments, judged from the command line alone: the
    launcher refuses before it starts anything (a server start costs minutes)."""
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    problems = [f"{f} is not supported by the dump hook" for f in _UNSUPPORTED_FLAGS if f in flags]
    values = _flag_values(argv)
    for flag, ok in _VALUED_FLAGS.items():
        if flag in values and values[flag] not in ok:
            problems.append(f"{flag} {values[flag]} is not supported by the dump hook")
    chunk = values.get("--chunked-prefill-size")
    if chunk is not None:
        problems += chunked_prefill_problems(_int_or_none(chunk), f"--chunked-prefill-size {chunk}")
    return problems


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def chunked_prefill_problems(chunk: int | None, shown: str) -> list[str]:
    """One rule for the command line and /server_info: an integer, -1 (off) or >= 1024."""
    if chunk is None:
        return [f"{shown}: expected an integer (-1 = off)"]
    if 0 < chunk < MIN_CHUNKED_PREFILL or chunk == 0 or chunk < -1:
        return [
            f"{shown}: long prompts split into many chunks, each a separate forward and D2H "
            f"copy; use >= {MIN_CHUNKED_PREFILL} or -1"
        ]
    return []


def check_model_config(
    config: Mapping[str, Any], layer_ids: Sequence[int] | None, *, deepseek_first_id_rule: bool
) -> list[str]:
    """Problems the launcher can see in a local checkpoint's config.json before starting:
    layer ids the model cannot capture (the plugin refuses them again at load)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, Mapping)
    archs = config.get("architectures")
    arch = str(archs[0]) if isinstance(archs, list) and archs else ""
    num_layers = text.get("num_hidden_layers")
    fam = family(arch)
    if fam is None or not isinstance(num_layers, int) or isinstance(num_layers, bool):
        return []  # unknown family: the plugin checks what the loaded model captures
    try:
        effective_layer_ids(
            fam, num_layers, layer_ids, deepseek_first_id_rule=deepseek_first_id_rule
        )
    except ValueError as exc:
        return [f"--layers: {exc}"]
    return []


def _count(v: Any) -> int:
    # Untrusted (/server_info JSON): a non-integer counts as 1, never raises.
    return v if isinstance(v, int) and not isinstance(v, bool) else 1


_PREFILL_CP_FLAGS = (
    "enable_prefill_cp",
    "enable_prefill_context_parallel",
    "enable_dsa_prefill_context_parallel",
    "enable_nsa_prefill_context_parallel",
)
SERVER_ARG_KEYS = (
    "disable_radix_cache",
    "dp_size",
    "attn_dp_size",
    "enable_dp_attention",
    "pp_size",
    "tp_size",
    "attn_cp_size",
    *_PREFILL_CP_FLAGS,
    "enable_two_batch_overlap",
    "moe_a2a_backend",
    "moe_dense_tp_size",
    "enable_layernorm_sp",
    "cuda_graph_backend_prefill",
    "disable_prefill_cuda_graph",
    "disable_piecewise_cuda_graph",
    "speculative_algorithm",
    "enable_return_hidden_states",
)
"""The server settings ``refusals`` reads (from ServerArgs in the plugin, /server_info here)."""


def refusals(v: Mapping[str, Any]) -> list[str]:
    """Settings under which the hook would dump wrong rows, nothing, or crash the server.

    One list for both places that check: the plugin refuses to start on any of them,
    whatever launched SGLang, and `hsq launch-sglang` checks /server_info against it.
    A key that is absent (an older SGLang without that feature) is not a problem.
    """
    return _layout_refusals(v) + _feature_refusals(v)


def _layout_refusals(v: Mapping[str, Any]) -> list[str]:
    # Layouts where attention-TP rank 0 does not hold every row of the batch plan.
    out: list[str] = []
    if _count(v.get("dp_size")) > 1:
        out.append("--dp-size > 1: one scheduler must own the dump dir")
    if _count(v.get("attn_dp_size")) > 1 or v.get("enable_dp_attention"):
        out.append("DP attention (attn_dp_size > 1): its padded rows are not the batch plan's")
    if _count(v.get("pp_size")) > 1:
        out.append("pipeline parallelism is not supported (aux capture is per stage)")
    if _count(v.get("attn_cp_size")) > 1 or any(v.get(k) for k in _PREFILL_CP_FLAGS):
        out.append("prefill context parallelism: 0.5.15 gathers only the final state")
    if v.get("moe_a2a_backend") not in (None, "none"):
        out.append(
            f"--moe-a2a-backend {v.get('moe_a2a_backend')}: attention-TP sequence sharding, "
            "rank 0 sees only its share of the rows"
        )
    if v.get("moe_dense_tp_size") not in (None, v.get("tp_size")):
        out.append(
            f"--moe-dense-tp-size {v.get('moe_dense_tp_size')}: attention-TP sequence "
            "sharding, rank 0 sees only its share of the rows"
        )
    if v.get("enable_layernorm_sp"):
        out.append("--enable-layernorm-sp: the rows differ from the batch plan")
    return out


def _feature_refusals(v: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    if v.get("disable_radix_cache") is not True:
        out.append(
            "radix cache is on: a cached prefix is not recomputed, so its states are never "
            "dumped (launch with --disable-radix-cache)"
        )
    if v.get("enable_two_batch_overlap"):
        out.append(
            "--enable-two-batch-overlap: each micro-batch captures part of the layers; "
            "AuxHiddenStatePacker.finalize() crashes the server on 0.5.23 DeepSeek"
        )
    if v.get("cuda_graph_backend_prefill") not in (None, "disabled"):
        out.append(
            f"--cuda-graph-backend-prefill {v.get('cuda_graph_backend_prefill')}: overrides "
            "--disable-prefill-cuda-graph (which /server_info still shows), and aux capture "
            "under prefill graphs was never verified"
        )
    for key in ("disable_prefill_cuda_graph", "disable_piecewise_cuda_graph"):
        if v.get(key) is False:
            out.append(
                f"{key} is false: prefill CUDA graphs are on, unverified with aux "
                "capture (launch with --" + key.replace("_", "-") + ")"
            )
    if v.get("speculative_algorithm"):
        out.append(
            f"speculative decoding ({v['speculative_algorithm']}) is on: a draft model "
            "also runs the logits processor"
        )
    if v.get("enable_return_hidden_states"):
        out.append(
            "--enable-return-hidden-states is on: not needed, and a request asking "
            "for it costs a .tolist() on the scheduler thread"
        )
    return out


def check_server_info(info: Mapping[str, Any]) -> list[str]:
    """Problems in a dumping server's /server_info (empty: good to go)."""
    problems = refusals(info)
    chunk = info.get("chunked_prefill_size")
    ok_int = isinstance(chunk, int) and not isinstance(chunk, bool)
    problems += chunked_prefill_problems(
        chunk if ok_int else None, f"chunked_prefill_size {chunk!r}"
    )
    version = info.get("version")
    if version is not None and str(version) not in PINNED_VERSIONS:
        problems.append(f"sglang {version} is not a pinned version {list(PINNED_VERSIONS)}")
    return problems
