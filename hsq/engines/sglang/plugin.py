"""The SGLang glue: three hooks that feed DumpHook. Only this module touches SGLang.

- AROUND ``ModelRunner.load_model``: before the weights load, refuse settings and layer
  ids that break capture; after, turn aux capture on (before attention backends and
  CUDA graphs are set up), check the layers the model will capture, build DumpHook and
  write the readiness marker (hsq.dump.ready.ReadyMarker) that workers wait for.
- AROUND ``Scheduler.run_batch``: snapshot the batch plan of a prefill batch.
- AROUND ``LogitsProcessor.forward``: the one point where every token's final (post-norm)
  and aux states are visible for every model; hand them to DumpHook.
- With SGLANG_HS_PRENORM=1, a forward hook on the model's final norm module: its input,
  the final layer's output before the norm, is kept for the logits call of the same forward.

``register`` is the ``sglang.srt.plugins`` entry point (sglang >= 0.5.11: load_plugins()
runs it in every scheduler process). ``install_patches`` does the same by assignment for
older versions, called at the top level of legacy_launch.py. SGLang is imported lazily, inside
these functions, so the module imports (and type-checks) without it.
"""

from __future__ import annotations

import functools
import logging
import os
import pkgutil
import threading
from collections.abc import Callable
from typing import Any

from hsq.engines.common import DumpContext, forget_marker, model_identity
from hsq.engines.sglang import compat
from hsq.engines.sglang.config import ENV_LAYER_IDS, ENV_PRENORM, HookConfig
from hsq.engines.sglang.dump_hook import DumpHook, batch_input_ids
from hsq.engines.sglang.launch_args import SERVER_ARG_KEYS, refusals
from hsq.engines.sglang.layers import (
    PRENORM_FAMILIES,
    check_effective,
    effective_layer_ids,
    family,
    find_capture_list,
    find_final_norm,
)
from hsq.engines.sglang.plan import BatchPlan
from hsq.errors import ConfigError

log = logging.getLogger("hsq.sglang_hook")
_MARK = "__hsq_dump_hook__"

_hook: DumpHook | None = None
_plan = threading.local()  # run_batch and the forward it launches share the thread
_prenorm = threading.local()  # the final norm's input in the planned forward, if tapped


def _config() -> HookConfig | None:
    return HookConfig.from_env(os.environ)


def _sglang_version() -> str:
    import sglang  # type: ignore[import-not-found,unused-ignore]

    return str(sglang.__version__)


def _attn_tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import (  # type: ignore[import-not-found,unused-ignore]
            get_parallel,
        )

        return int(get_parallel().attn_tp_rank)
    except (ImportError, AttributeError):
        from sglang.srt.layers.dp_attention import (  # type: ignore[import-not-found,unused-ignore]
            get_attention_tp_rank,
        )

        return int(get_attention_tp_rank())


# ---------------------------------------------------------------------------- hooks


def server_arg_values(server_args: Any) -> dict[str, Any]:
    """The resolved settings, as /server_info reports them (0.5.2x resolves lazily: the
    raw attributes may not be what runs), else the plain attributes ``refusals`` reads."""
    resolved = getattr(server_args, "resolved_dict", None)
    if callable(resolved):
        try:
            return dict(resolved())
        except Exception:  # fall back to the raw fields rather than skip the check
            log.warning("hs_dump: ServerArgs.resolved_dict() failed; reading raw fields")
    return {k: getattr(server_args, k) for k in SERVER_ARG_KEYS if hasattr(server_args, k)}


def _text_config(runner: Any) -> tuple[Any, str, int]:
    """(model config, architecture, num layers), known before the weights load."""
    mc = runner.model_config
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    archs = getattr(mc.hf_config, "architectures", None) or ["unknown"]
    return mc, str(archs[0]), int(text.num_hidden_layers)


def preflight(runner: Any, cfg: HookConfig, version: str) -> list[int] | None:
    """Refuse before the weights load: unsupported settings or layer ids (ConfigError,
    which SGLang's scheduler logs before it takes the server down). Returns the layers
    the model is predicted to capture, None for an architecture without a known rule."""
    problems = refusals(server_arg_values(runner.server_args))
    _, arch, num_layers = _text_config(runner)
    fam = family(arch)
    predicted = None
    if fam is not None:
        rule = compat.deepseek_first_id_rule(version)
        try:
            predicted = effective_layer_ids(
                fam, num_layers, cfg.layer_ids, deepseek_first_id_rule=rule
            )
        except ValueError as exc:
            problems.append(f"{ENV_LAYER_IDS}: {exc}")
    if cfg.prenorm and fam not in PRENORM_FAMILIES:
        problems.append(
            f"{ENV_PRENORM}=1: the pre-norm final state is captured only for the model "
            "families whose final norm hsq has read in SGLang's source (Llama, Mistral, "
            f"Qwen2/3, Qwen3-MoE, DeepSeek-V2/V3, Kimi-K2.5), not {arch}"
        )
    if problems:
        raise ConfigError("hs_dump: refusing to start: " + "; ".join(problems))
    return predicted


def around_load_model(orig: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    cfg = _config()
    if cfg is None or getattr(runner, "is_draft_worker", False):
        return orig(runner, *args, **kwargs)
    version = _sglang_version()
    predicted = preflight(runner, cfg, version)
    if _attn_tp_rank() == 0:
        # A marker left by an earlier server must not vouch for this one while it loads.
        forget_marker(cfg.dump_dir)
    result = orig(runner, *args, **kwargs)
    _install(runner, cfg, predicted, version)
    return result


def _install(runner: Any, cfg: HookConfig, predicted: list[int] | None, version: str) -> None:
    """After the load: turn aux capture on, check what the model captures, build the
    DumpHook and announce it with the readiness marker."""
    global _hook
    model = runner.model
    ids = list(cfg.layer_ids) if cfg.layer_ids is not None else None
    # SGLang's own per-model id rule; wrappers without it (Kimi-K2.5 before 0.5.2x)
    # delegate to their language model.
    setter = getattr(model, "set_eagle3_layers_to_capture", None) or getattr(
        getattr(model, "language_model", None), "set_eagle3_layers_to_capture", None
    )
    if setter is None:
        raise ConfigError(f"hs_dump: {type(model).__name__} has no EAGLE-3 aux capture")
    setter(ids)
    captured = find_capture_list(model)
    if captured is None:
        raise ConfigError(
            f"hs_dump: {type(model).__name__} set no layers_to_capture; this model (or a "
            "non-last pipeline stage) cannot be dumped"
        )
    mc, arch, num_layers = _text_config(runner)
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    ident = model_identity(
        str(mc.model_path), arch, num_layers, int(text.hidden_size), mc.hf_config.to_dict()
    )
    try:
        check_effective(captured, num_layers)
    except ValueError as exc:
        raise ConfigError(f"hs_dump: the model captures {captured}: {exc}") from exc
    effective = sorted(captured)
    if predicted is None:
        log.warning("hs_dump: %s has no known layer-id rule; recording the model's list", arch)
    elif predicted != effective:
        raise ConfigError(
            f"hs_dump: expected layers {predicted} for {arch} on sglang {version}, the model "
            f"captures {effective}: refusing to dump under a rule hsq does not know"
        )
    hook = DumpHook(cfg, DumpContext(ident, effective), attn_tp_rank=_attn_tp_rank())
    if cfg.prenorm and hook.is_writer:
        norm = find_final_norm(model)
        if norm is None:
            hook.close()
            raise ConfigError(
                f"hs_dump: {ENV_PRENORM}=1 but {type(model).__name__} has no final norm "
                "module at model.norm (or language_model.model.norm): cannot capture the "
                "pre-norm state"
            )
        norm.register_forward_hook(_tap_prenorm, with_kwargs=True)  # type: ignore[attr-defined]
    _hook = hook
    if _hook.sink is not None:  # the writer announces what its dumps hold
        _hook.sink.announce("sglang", version)
    log.info(
        "hs_dump: %s layers %s -> %s (writer=%s)", ident.model_id, ids, effective, _hook.is_writer
    )


def _tap_prenorm(_norm: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    """Forward hook of the final norm: keep its input for this forward's logits call.

    Called with a residual, SGLang's RMSNorm returns (normed, hidden + residual): the
    second element is exactly the stream the norm normalized (the fused kernel writes it
    in place, so the input tensors no longer hold it). Without one it is out of place and
    its input is the stream. Only during a planned prefill: decode forwards pay nothing.
    """
    if getattr(_plan, "value", None) is None:
        return
    if isinstance(output, tuple) and len(output) == 2:
        _prenorm.value = output[1]
    else:
        _prenorm.value = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))


def _is_prefill(mode: Any) -> bool:
    # is_extend() would also take verify/draft/DLLM passes; only real prefills count.
    return getattr(mode, "name", "") in ("EXTEND", "MIXED")


def around_run_batch(orig: Callable[..., Any], sched: Any, batch: Any, *a: Any, **k: Any) -> Any:
    hook = _hook
    plan: BatchPlan | None = None
    if hook is not None and hook.is_writer and _is_prefill(batch.forward_mode):
        try:
            reqs = batch.reqs
            plan = hook.plan(
                reqs,
                batch.prefix_lens,
                batch.extend_lens,
                skip=[getattr(r, "to_finish", None) is not None for r in reqs],
            )
        except Exception:  # dumping must never take serving down
            log.exception("hs_dump: batch plan failed")
    _plan.value = plan
    _prenorm.value = None
    try:
        return orig(sched, batch, *a, **k)
    finally:
        _plan.value = None
        _prenorm.value = None


def around_logits(orig: Callable[..., Any], proc: Any, *args: Any, **kwargs: Any) -> Any:
    plan: BatchPlan | None = getattr(_plan, "value", None)
    hook = _hook
    if plan is not None and hook is not None:
        _plan.value = None  # the batch's first logits call is the target model's
        prenorm, _prenorm.value = getattr(_prenorm, "value", None), None
        try:
            input_ids = args[0] if len(args) > 0 else kwargs.get("input_ids")
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            meta = args[3] if len(args) > 3 else kwargs.get("logits_metadata")
            aux = args[4] if len(args) > 4 else kwargs.get("aux_hidden_states")
            hook.capture(plan, batch_input_ids(input_ids, meta), hidden, aux, prenorm)
        except Exception:
            log.exception("hs_dump: capture failed")
    return orig(proc, *args, **kwargs)


HOOKS: tuple[tuple[compat.Symbol, Callable[..., Any], str], ...] = (
    (compat.LOAD_MODEL, around_load_model, "AROUND"),
    (compat.RUN_BATCH, around_run_batch, "AROUND"),
    (compat.LOGITS_FORWARD, around_logits, "AROUND"),
)


# ---------------------------------------------------------------------------- install


def _resolve(target: str) -> tuple[Any, str, Any]:
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    return owner, attr, getattr(owner, attr)


def _config_or_exit() -> HookConfig | None:
    try:
        return _config()
    except ValueError as exc:
        raise SystemExit(f"hs_dump: refusing to start: {exc}") from exc


def register() -> None:
    """Entry point (group sglang.srt.plugins): hand the hooks to SGLang's HookRegistry.

    SGLang's load_plugins() catches every Exception a plugin raises and only logs it, so a
    bad setting would leave a server that serves and never dumps. SystemExit is not an
    Exception: it stops the launcher (and any scheduler) with the message.
    """
    cfg = _config_or_exit()  # a typo'd SGLANG_HS_* or bad layer ids stop here, at startup
    if cfg is None:
        log.info("hs_dump: SGLANG_HS_DUMP_DIR unset, hidden-state dumping is off")
        return
    from sglang.srt.plugins.hook_registry import (  # type: ignore[import-not-found,unused-ignore]
        HookRegistry,
        HookType,
    )

    for sym, fn, kind in HOOKS:
        if getattr(_resolve(sym.target)[2], _MARK, False):
            continue  # legacy_launch.py patched this process already
        HookRegistry.register(sym.target, fn, getattr(HookType, kind))
    log.info("hs_dump: hooks registered, dumping to %s", cfg.dump_dir)


def _wrap(orig: Callable[..., Any], fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    # The same calling conventions as HookRegistry's AFTER and AROUND wrappers.
    if kind == "AFTER":

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = orig(*args, **kwargs)
            new = fn(result, *args, **kwargs)
            return result if new is None else new

    else:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(orig, *args, **kwargs)

    functools.update_wrapper(wrapper, orig)
    setattr(wrapper, _MARK, True)
    return wrapper


def install_patches() -> bool:
    """Patch by assignment (sglang < 0.5.11, or no plugin installed); idempotent.

    Returns whether the hooks are in place.
    """
    if _config_or_exit() is None:
        log.warning("hs_dump: SGLANG_HS_DUMP_DIR unset, hidden-state dumping is off")
        return False
    for sym, fn, kind in HOOKS:
        owner, attr, orig = _resolve(sym.target)
        if not getattr(orig, _MARK, False):
            setattr(owner, attr, _wrap(orig, fn, kind))
    return True
