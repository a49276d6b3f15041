"""Which SGLang versions the hook supports, and every SGLang name it relies on.

One table, read by the glue (to pick plugin or launcher, and the layer-id rule) and by
tests/test_sglang_conformance.py, which checks with `ast` that each pinned wheel really has
these names. When SGLang moves something, the conformance test fails here first, not on a
GPU box. Names are checked in source, never imported: SGLang is not installed for tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# Newest first. 0.5.15 is where chunk bookkeeping and the DeepSeek layer rule changed;
# 0.5.9 is the oldest, served only by the launcher (no plugin API). 0.5.16-0.5.22 are read
# like the others; only 0.5.15 ran live (docs/sglang.md, "Versions").
PINNED_VERSIONS: tuple[str, ...] = (
    "0.5.23",
    "0.5.22",
    "0.5.21",
    "0.5.20",
    "0.5.19",
    "0.5.18",
    "0.5.17",
    "0.5.16",
    "0.5.15",
    "0.5.11",
    "0.5.9",
)
LIVE_VERSIONS: tuple[str, ...] = ("0.5.15",)
"""Versions seen working in a live server on a GPU (the rest: read only)."""
PLUGIN_MIN_VERSION = (0, 5, 11)
"""`sglang.srt.plugins` (entry points + HookRegistry) exists from this release on."""
DEEPSEEK_FIRST_ID_RULE_SINCE = (0, 5, 13)
"""From here DeepSeek/Kimi add +1 only when the first id is 1 (read in 0.5.12..0.5.15)."""
PREFILL_GRAPH_FLAG_SINCE = (0, 5, 15)
"""`--disable-prefill-cuda-graph` (breakable prefill graphs are on by default)."""
DEEPSEEK_PACKED_AUX_SINCE = (0, 5, 17)
"""From here DeepSeek/Kimi hand the logits processor one packed [T, K*H] aux tensor
(AuxHiddenStatePacker) instead of a list of K tensors; the tap takes both."""
TC_PIECEWISE_PREFILL_UNTIL = (0, 5, 22)
"""`tc_piecewise` is a --cuda-graph-backend-prefill choice below this; 0.5.22 dropped it
(full, breakable, disabled remain). The hook accepts `disabled` only, in every version."""
PIECEWISE_GRAPH_FLAG_RANGE = ((0, 5, 11), (0, 5, 15))
"""`--disable-piecewise-cuda-graph` is the prefill-graph switch in [start, end); on by
default there (0.5.9 had it opt-in, 0.5.10 was not read)."""

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "hsq_dump"
ENTRY_POINT_VALUE = "hsq.engines.sglang.plugin:register"

Kind = Literal["def", "class", "attr", "text"]


@dataclass(frozen=True)
class Symbol:
    """One name in one SGLang module.

    kind "def": a function or method (qualname "Cls.meth"), whose parameters start with
    ``params`` in that order. "class": a class. "attr": a class-level field or a
    ``self.<name> = ...`` assignment in any method. "text": ``qualname`` occurs in the
    module's source (for names SGLang builds dynamically; a weak check, said so in docs).
    """

    module: str
    qualname: str
    kind: Kind = "def"
    params: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    """For "def": names the body must call (e.g. run_scheduler_process -> load_plugins)."""

    @property
    def paths(self) -> tuple[str, str]:
        """Where the module's source may live in a wheel: a module or a package."""
        base = self.module.replace(".", "/")
        return f"{base}.py", f"{base}/__init__.py"

    @property
    def target(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass(frozen=True)
class Requirement:
    """What the hook needs; met when any alternative exists in the version's source."""

    why: str
    alternatives: tuple[Symbol, ...]
    since: tuple[int, int, int] | None = None
    """Only versions at or above this need it (e.g. the plugin API)."""
    until: tuple[int, int, int] | None = None
    """Only versions below this need it."""


_SCHED = "sglang.srt.managers.scheduler"
_BATCH = "sglang.srt.managers.schedule_batch"
_LOGITS = "sglang.srt.layers.logits_processor"
_RUNNER = "sglang.srt.model_executor.model_runner"
_FBI = "sglang.srt.model_executor.forward_batch_info"

# The three hook targets, as the HookRegistry dotted paths the plugin registers.
RUN_BATCH = Symbol(_SCHED, "Scheduler.run_batch", params=("self", "batch"))
LOGITS_FORWARD = Symbol(
    _LOGITS,
    "LogitsProcessor.forward",
    params=(
        "self",
        "input_ids",
        "hidden_states",
        "lm_head",
        "logits_metadata",
        "aux_hidden_states",
    ),
)
LOAD_MODEL = Symbol(_RUNNER, "ModelRunner.load_model", params=("self",))
HOOK_TARGETS: tuple[Symbol, ...] = (LOAD_MODEL, RUN_BATCH, LOGITS_FORWARD)


def _field(
    name: str,
    group: tuple[str, str] | None,
    since: tuple[int, int, int] | None = None,
    until: tuple[int, int, int] | None = None,
) -> Requirement:
    # Before 0.5.2x ServerArgs was one dataclass; later the fields live in per-group
    # msgspec records (module, class), flattened again by /server_info.
    alts = [Symbol("sglang.srt.server_args", f"ServerArgs.{name}", "attr")]
    if group is not None:
        alts.append(
            Symbol(f"sglang.srt.arg_groups.fields.{group[0]}", f"{group[1]}.{name}", "attr")
        )
    return Requirement(f"server arg {name} (flag / /server_info key)", tuple(alts), since, until)


def _one(why: str, sym: Symbol, since: tuple[int, int, int] | None = None) -> Requirement:
    return Requirement(why, (sym,), since)


REQUIREMENTS: tuple[Requirement, ...] = (
    *(_one("hook target", s) for s in HOOK_TARGETS),
    # Batch plan, read in Scheduler.run_batch.
    _one("batch requests", Symbol(_BATCH, "ScheduleBatch.reqs", "attr")),
    _one("cached prefix per request", Symbol(_BATCH, "ScheduleBatch.prefix_lens", "attr")),
    _one("rows per request", Symbol(_BATCH, "ScheduleBatch.extend_lens", "attr")),
    _one("batch mode", Symbol(_BATCH, "ScheduleBatch.forward_mode", "attr")),
    _one("request id", Symbol(_BATCH, "Req.rid", "attr")),
    _one("request length", Symbol(_BATCH, "Req.origin_input_ids", "attr")),
    _one("aborted before prefill", Symbol(_BATCH, "Req.to_finish", "attr")),
    _one("prefill mode", Symbol(_FBI, "ForwardMode.EXTEND", "attr")),
    _one("mixed prefill mode", Symbol(_FBI, "ForwardMode.MIXED", "attr")),
    # Which rank writes.
    Requirement(
        "attention-TP rank",
        (
            Symbol("sglang.srt.runtime_context", "get_parallel"),
            Symbol("sglang.srt.layers.dp_attention", "get_attention_tp_rank"),
        ),
    ),
    _one(
        "attn_tp_rank on get_parallel()",
        Symbol("sglang.srt.runtime_context", "attn_tp_rank", "text"),
        (0, 5, 15),
    ),
    # Layer capture and model identity, read after ModelRunner.load_model.
    _one("loaded model", Symbol(_RUNNER, "ModelRunner.model", "attr")),
    _one("model config", Symbol(_RUNNER, "ModelRunner.model_config", "attr")),
    _one("draft runner flag", Symbol(_RUNNER, "ModelRunner.is_draft_worker", "attr")),
    _one("model path", Symbol("sglang.srt.configs.model_config", "ModelConfig.model_path", "attr")),
    _one("HF config", Symbol("sglang.srt.configs.model_config", "ModelConfig.hf_config", "attr")),
    _one(
        "HF text config",
        Symbol("sglang.srt.configs.model_config", "ModelConfig.hf_text_config", "attr"),
    ),
    *(
        _one(
            "layer capture setter",
            Symbol(
                f"sglang.srt.models.{m}",
                f"{cls}.set_eagle3_layers_to_capture",
                params=("self", "layer_ids"),
            ),
        )
        for m, cls in (("llama", "LlamaForCausalLM"), ("deepseek_v2", "DeepseekV2ForCausalLM"))
    ),
    _one(
        "captured layer list",
        Symbol("sglang.srt.models.llama", "LlamaModel.layers_to_capture", "attr"),
    ),
    _one(
        "captured layer list",
        Symbol("sglang.srt.models.deepseek_v2", "DeepseekV2Model.layers_to_capture", "attr"),
    ),
    # Launcher path (every version).
    _one(
        "launcher: parse args",
        Symbol("sglang.srt.server_args", "prepare_server_args", params=("argv",)),
    ),
    _one("launcher: run", Symbol("sglang.launch_server", "run_server", params=("server_args",))),
    _one(
        "launcher: cleanup",
        Symbol("sglang.launch_server", "from sglang.srt.utils import kill_process_tree", "text"),
    ),
    # Plugin path.
    _one(
        "plugin registry",
        Symbol(
            "sglang.srt.plugins.hook_registry",
            "HookRegistry.register",
            params=("cls", "target", "hook", "hook_type"),
        ),
        PLUGIN_MIN_VERSION,
    ),
    *(
        _one(
            "hook type",
            Symbol("sglang.srt.plugins.hook_registry", f"HookType.{t}", "attr"),
            PLUGIN_MIN_VERSION,
        )
        for t in ("AFTER", "AROUND")
    ),
    _one("plugin loader", Symbol("sglang.srt.plugins", "load_plugins"), PLUGIN_MIN_VERSION),
    _one(
        "plugin entry-point group",
        Symbol("sglang.srt.plugins", f'"{ENTRY_POINT_GROUP}"', "text"),
        PLUGIN_MIN_VERSION,
    ),
    _one(
        "plugins load in each scheduler",
        Symbol(_SCHED, "run_scheduler_process", calls=("load_plugins",)),
        PLUGIN_MIN_VERSION,
    ),
    # Flags launch_command emits and keys check_server_info reads.
    _field("disable_radix_cache", ("memory", "Memory")),
    _field("chunked_prefill_size", ("schedule", "Schedule")),
    _field("tp_size", ("parallel", "Parallel")),
    _field("dp_size", ("parallel", "Parallel")),
    _field("enable_dp_attention", ("parallel", "Parallel")),
    _field("disable_overlap_schedule", ("schedule", "Schedule")),
    _field("enable_return_hidden_states", ("exec_", "ExecFeatures")),
    _field("disable_prefill_cuda_graph", ("exec_", "ExecGraph"), since=PREFILL_GRAPH_FLAG_SINCE),
    _field("disable_piecewise_cuda_graph", None, *PIECEWISE_GRAPH_FLAG_RANGE),
    # Settings the plugin refuses at start-up (cli.refusals), read from ServerArgs.
    _one("server args of the runner", Symbol(_RUNNER, "ModelRunner.server_args", "attr")),
    _one(
        "resolved server args (0.5.2x resolves lazily)",
        Symbol("sglang.srt.server_args", "ServerArgs.resolved_dict", params=("self",)),
        (0, 5, 23),
    ),
    _field("enable_two_batch_overlap", ("exec_", "ExecOverlap")),
    _field("moe_a2a_backend", ("exec_", "ExecMoe")),
    _field("moe_dense_tp_size", ("parallel", "Parallel")),
    _field("attn_cp_size", ("parallel", "Parallel")),
    _field("speculative_algorithm", ("spec", "Spec")),
    _field("cuda_graph_backend_prefill", ("exec_", "ExecGraph"), since=(0, 5, 15)),
    _field("enable_prefill_cp", ("parallel", "Parallel"), since=(0, 5, 15)),
    _field("enable_layernorm_sp", ("parallel", "Parallel"), since=(0, 5, 23)),
    _field("attn_dp_size", ("parallel", "Parallel"), since=(0, 5, 23)),
    # Kimi-K2.5: the language model gets input_ids=None; the ids come from the batch.
    _one("token ids of the batch", Symbol(_FBI, "ForwardBatch.input_ids", "attr")),
)


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.5.13.post1' -> (0, 5, 13); suffixes do not change which code path applies."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", text.strip())
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def plugin_supported(version: str) -> bool:
    return parse_version(version) >= PLUGIN_MIN_VERSION


def deepseek_first_id_rule(version: str) -> bool:
    return parse_version(version) >= DEEPSEEK_FIRST_ID_RULE_SINCE


def deepseek_packs_aux(version: str) -> bool:
    return parse_version(version) >= DEEPSEEK_PACKED_AUX_SINCE


def prefill_graph_backends(version: str) -> tuple[str, ...]:
    """--cuda-graph-backend-prefill's choices in this version (0.5.15 and later)."""
    if parse_version(version) < TC_PIECEWISE_PREFILL_UNTIL:
        return ("full", "breakable", "tc_piecewise", "disabled")
    return ("full", "breakable", "disabled")


def requirements_for(version: str) -> list[Requirement]:
    v = parse_version(version)
    return [
        r
        for r in REQUIREMENTS
        if (r.since is None or v >= r.since) and (r.until is None or v < r.until)
    ]


def prefill_graph_off_flags(version: str) -> list[str]:
    """The flag that turns prefill CUDA graphs off in this version (none before 0.5.12)."""
    v = parse_version(version)
    if v >= PREFILL_GRAPH_FLAG_SINCE:
        return ["--disable-prefill-cuda-graph"]
    lo, hi = PIECEWISE_GRAPH_FLAG_RANGE
    if lo <= v < hi:
        return ["--disable-piecewise-cuda-graph"]
    return []
