"""Every SGLang name the dump hook relies on exists in every pinned SGLang version.

Reads the wheels that scripts/fetch_sglang_sources.sh puts in .cache/sglang/ as files
and parses them with `ast` (hsq/engines/sglang/srccheck.py); SGLang is never
imported or run. Without the cache the tests skip locally and fail in CI (env CI set),
where `make setup` fetches it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest

from hsq.engines.sglang import compat, srccheck
from hsq.engines.sglang.compat import PINNED_VERSIONS, Symbol
from hsq.engines.sglang.srccheck import SourceReader, SourceTree
from tests.support.sglangsrc import wheel_reader


@pytest.fixture(params=PINNED_VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def source(version: str) -> Iterator[SourceReader]:
    yield from wheel_reader(version)


def _function_source(read: SourceReader, sym: Symbol) -> str:
    tree = SourceTree(read)
    mod = tree.module(sym)
    assert mod is not None, sym.module
    cls_name, fn_name = sym.qualname.split(".")
    for node in ast.walk(mod[0]):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == fn_name:
                    return ast.unparse(item)
    raise AssertionError(f"{sym.target} not found")


def test_pinned_versions_are_newest_first_and_cover_both_paths() -> None:
    parsed = [compat.parse_version(v) for v in PINNED_VERSIONS]
    assert parsed == sorted(parsed, reverse=True)
    assert "0.5.11" in PINNED_VERSIONS
    assert any(not compat.plugin_supported(v) for v in PINNED_VERSIONS)  # launcher path
    assert compat.plugin_supported(PINNED_VERSIONS[0])


def test_every_symbol_the_hook_uses_exists(version: str, source: SourceReader) -> None:
    assert srccheck.check(source, version) == []


def test_the_plugin_entry_point_group_is_sglangs(version: str, source: SourceReader) -> None:
    if not compat.plugin_supported(version):
        pytest.skip(f"sglang {version} has no plugin API; legacy_launch.py serves it")
    text = source("sglang/srt/plugins/__init__.py")
    assert text is not None
    assert f'GENERAL_PLUGINS_GROUP = "{compat.ENTRY_POINT_GROUP}"' in text


def test_deepseek_layer_rule_matches_the_source(version: str, source: SourceReader) -> None:
    sym = Symbol(
        "sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture"
    )
    body = _function_source(source, sym)
    assert ("layer_ids[0] == 1" in body) == compat.deepseek_first_id_rule(version)
    assert "[2, num_layers // 2, num_layers - 3]" in body


def test_llama_layer_rule_matches_the_source(source: SourceReader) -> None:
    sym = Symbol("sglang.srt.models.llama", "LlamaForCausalLM.set_eagle3_layers_to_capture")
    body = _function_source(source, sym)
    assert "[val + 1 for val in layer_ids]" in body
    assert "[2, num_layers // 2, num_layers - 3]" in body


def test_the_checker_reports_what_is_missing() -> None:
    """Not vacuous: the oldest version lacks the plugin API, and a renamed parameter or a
    missing attribute is reported."""
    oldest = PINNED_VERSIONS[-1]
    for read in wheel_reader(oldest):
        problems = srccheck.check(read, "0.5.11")  # oldest source, plugin-era requirements
        assert any("plugin registry" in p for p in problems)
        tree = SourceTree(read)
        renamed = Symbol(
            compat.LOGITS_FORWARD.module,
            compat.LOGITS_FORWARD.qualname,
            params=("self", "input_ids", "hidden", "lm_head"),
        )
        assert "parameters" in (tree.problem(renamed) or "")
        assert tree.problem(Symbol(compat.RUN_BATCH.module, "Scheduler.no_such", "attr"))
        assert tree.problem(compat.RUN_BATCH) is None


def _call_args(read: SourceReader, sym: Symbol, callee: str) -> list[list[str]]:
    """Each call to ``callee`` (a name or attribute) in a function: its arguments, as
    source, positional first then ``key=value``."""
    tree = SourceTree(read)
    mod = tree.module(sym)
    assert mod is not None, sym.module
    *owner, name = sym.qualname.split(".")
    scope: ast.AST = mod[0]
    if owner:
        scope = next(
            n for n in ast.walk(mod[0]) if isinstance(n, ast.ClassDef) and n.name == owner[0]
        )
    fn = next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name)
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == callee) or (
                isinstance(f, ast.Attribute) and f.attr == callee
            ):
                out.append(
                    [ast.unparse(a) for a in node.args]
                    + [f"{k.arg}={ast.unparse(k.value)}" for k in node.keywords]
                )
    return out


def test_kimi_calls_the_language_model_with_input_ids_none(source: SourceReader) -> None:
    """Why Kimi-K2.5 dumps once failed, pinned: Kimi-K2.5 -> general_mm_embed_routine -> language
    model with input_ids=None -> DeepseekV2 passes that None and the ForwardBatch to the
    logits processor in positions 0 and 3, where plugin.around_logits reads them."""
    kimi = Symbol("sglang.srt.models.kimi_k25", "KimiK25ForConditionalGeneration.forward")
    assert _call_args(source, kimi, "general_mm_embed_routine")
    routine = Symbol("sglang.srt.managers.mm_utils", "general_mm_embed_routine")
    calls = _call_args(source, routine, "language_model")
    assert calls and all("input_ids=None" in c for c in calls)
    ds = Symbol("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM.forward")
    assert ["input_ids", "hidden_states", "self.lm_head", "forward_batch", "aux_hidden_states"] in (
        _call_args(source, ds, "logits_processor")
    )


def _handlers(read: SourceReader, sym: Symbol) -> tuple[list[str], str]:
    """The exception types a function's handlers catch, and its source."""
    mod = SourceTree(read).module(sym)
    assert mod is not None, sym.module
    fn = next(
        n for n in ast.walk(mod[0]) if isinstance(n, ast.FunctionDef) and n.name == sym.qualname
    )
    types = [
        ast.unparse(h.type) if h.type else ""
        for h in ast.walk(fn)
        if isinstance(h, ast.ExceptHandler)
    ]
    return types, ast.unparse(fn)


def test_start_up_errors_stop_the_server(version: str, source: SourceReader) -> None:
    """Why the hook fails the way it does (docs/sglang.md, Start-up errors):
    load_plugins() swallows Exception from a plugin but not SystemExit, so register()
    raises SystemExit; run_scheduler_process() catches an Exception from building the
    Scheduler (our load hook's ConfigError) and SIGQUITs the server."""
    if compat.plugin_supported(version):
        caught, _ = _handlers(source, Symbol("sglang.srt.plugins", "load_plugins"))
        assert caught and set(caught) == {"Exception"}
    caught, body = _handlers(source, Symbol(compat.RUN_BATCH.module, "run_scheduler_process"))
    assert "Exception" in caught and "SIGQUIT" in body


# The SGLANG_HS_PRENORM tap (plugin._tap_prenorm): a forward hook on the inner model's
# `norm` module. Per model file, the class whose forward applies the final norm; a class
# without its own forward inherits it from the next candidate (Qwen3 from Qwen2, ...).
_FINAL_NORM_MODELS: dict[str, list[tuple[str, str]]] = {
    "llama": [("sglang.srt.models.llama", "LlamaModel")],
    "qwen2": [("sglang.srt.models.qwen2", "Qwen2Model")],
    "qwen3": [("sglang.srt.models.qwen3", "Qwen3Model"), ("sglang.srt.models.qwen2", "Qwen2Model")],
    "qwen3_moe": [
        ("sglang.srt.models.qwen3_moe", "Qwen3MoeModel"),
        ("sglang.srt.models.qwen2_moe", "Qwen2MoeModel"),
    ],
    "deepseek_v2": [("sglang.srt.models.deepseek_v2", "DeepseekV2Model")],
}


def _method(read: SourceReader, module: str, cls: str, name: str) -> str | None:
    mod = SourceTree(read).module(Symbol(module, f"{cls}.{name}"))
    assert mod is not None, module
    for node in ast.walk(mod[0]):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return ast.unparse(item)
    return None


@pytest.mark.parametrize("model", sorted(_FINAL_NORM_MODELS))
def test_final_norm_is_the_inner_models_norm_module(source: SourceReader, model: str) -> None:
    """Each family in layers.PRENORM_FAMILIES applies its final norm by calling the module
    `self.norm` (directly, or through 0.5.2x's residual_batch.final_norm), so a forward
    hook on model.norm sees every prefill's pre-norm state."""
    forward = next(
        (
            body
            for module, cls in _FINAL_NORM_MODELS[model]
            if (body := _method(source, module, cls, "forward")) is not None
        ),
        None,
    )
    assert forward is not None, model
    direct = "self.norm(hidden_states, residual)" in forward
    routed = "final_norm(hidden_states, forward_batch, self.norm" in forward
    # 0.5.21/0.5.22: residual_batch.norm -> access.norm_output -> norm(hidden, residual)
    routed_021 = "residual_batch.norm(hidden_states, forward_batch, self.norm" in forward
    assert direct or routed or routed_021, model
    inits = [_method(source, m, c, "__init__") or "" for m, c in _FINAL_NORM_MODELS[model]]
    assert any("self.norm = RMSNorm(" in body for body in inits), model


def test_rmsnorm_with_a_residual_returns_the_sum_it_normalized(source: SourceReader) -> None:
    """What the tap reads: called with a residual, RMSNorm returns (normed, hidden +
    residual); the CUDA path adds in place (fused_add_rmsnorm), so only the returned
    residual still holds the pre-norm state."""
    native = _method(source, "sglang.srt.layers.layernorm", "RMSNorm", "forward_native")
    cuda = _method(source, "sglang.srt.layers.layernorm", "RMSNorm", "forward_cuda")
    assert native is not None and cuda is not None
    assert "x = x + residual.to(torch.float32)" in native and "return (x, residual)" in native
    assert "fused_add_rmsnorm(x, residual" in cuda
    routed = source("sglang/srt/layers/layer_boundary/residual/access.py")
    if routed is not None:  # 0.5.2x: residual_batch.(final_)norm -> access.*: a module call
        assert "norm(hidden_states, residual, **read_kwargs)" in routed
