"""Which layers SGLang captures for a given list of EAGLE-3 layer ids.

SGLang captures the residual stream *entering* decoder layer i, which is HF
``hidden_states[i]``: hsq's "hf_hidden_states" convention. The ids a drafter config names
go through a per-model rule first (``set_eagle3_layers_to_capture``), so the same ids
capture different layers on Llama and on DeepSeek. meta.json records the effective list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Family = Literal["llama", "deepseek"]

# Architectures (HF `architectures[0]`) whose SGLang model class uses each rule, read in
# sglang 0.5.9..0.5.23 models/*.py. Anything else: the glue trusts what the model set.
LLAMA_FAMILY = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)
DEEPSEEK_FAMILY = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
    }
)


def family(architecture: str) -> Family | None:
    if architecture in LLAMA_FAMILY:
        return "llama"
    if architecture in DEEPSEEK_FAMILY:
        return "deepseek"
    return None


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: early, middle and late; SGLang uses it as is (no +1)."""
    return [2, num_layers // 2, num_layers - 3]


def effective_layer_ids(
    fam: Family,
    num_layers: int,
    ids: Sequence[int] | None,
    *,
    deepseek_first_id_rule: bool = True,
) -> list[int]:
    """The HF hidden_states indices SGLang captures when given ``ids``.

    Llama family: explicit ids get +1 (id i names the *output* of layer i). DeepSeek/Kimi:
    +1 only when the first id is 1 (``deepseek_first_id_rule``, sglang >= 0.5.13), else
    the ids as given; before 0.5.13 always +1. ``None``: the default, unchanged. The
    result is sorted because models capture while walking the layers in order, so that is
    the order of the packed aux tensor.

    Only ``0 <= id < num_layers``, each once: SGLang captures at the entry of layers in
    ``range(start_layer, end_layer)``, so id L never fires and a duplicate fires once;
    either leaves the aux list short (0.5.23 DeepSeek/Kimi: finalize() raises "captured
    2 of 3" and takes the server down at its first forward; Llama: every batch lost).
    """
    if ids is None:
        out = default_layer_ids(num_layers)
    elif fam == "deepseek" and deepseek_first_id_rule and (not ids or ids[0] != 1):
        out = list(ids)
    else:
        out = [i + 1 for i in ids]
    check_effective(out, num_layers)
    return sorted(out)


def check_effective(ids: Sequence[int], num_layers: int) -> None:
    """ValueError unless every id is in [0, num_layers) and none repeats."""
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad or not ids:
        raise ValueError(
            f"layer ids {list(ids)} out of range for a model of {num_layers} layers "
            f"(allowed: 0..{num_layers - 1}; {num_layers} is never captured)"
        )
    dups = sorted({i for i in ids if list(ids).count(i) > 1})
    if dups:
        raise ValueError(f"layer ids {list(ids)} capture {dups} twice; SGLang would come up short")


def parse_layer_ids(text: str | None) -> tuple[int, ...] | None:
    """'2,30,58' (or '2 30 58') -> (2, 30, 58); empty or 'default' -> None."""
    if text is None or text.strip().lower() in ("", "default"):
        return None
    try:
        ids = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(f"layer ids must be integers, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"layer ids must be >= 0, got {text!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer ids must not repeat, got {text!r}")
    return ids


def find_capture_list(model: object) -> list[int] | None:
    """The ``layers_to_capture`` list a loaded SGLang model holds, wherever it keeps it.

    Text models keep it on the inner ``model``; wrappers such as Kimi-K2.5 one level
    deeper, under ``language_model``.
    """
    for path in ("model", "language_model.model", "language_model", ""):
        obj: object = model
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        value = getattr(obj, "layers_to_capture", None)
        if isinstance(value, list | tuple) and value:
            return [int(v) for v in value]
    return None


PRENORM_FAMILIES: tuple[Family, ...] = ("llama", "deepseek")
"""Families whose SGLang model calls its final norm as a module, ``self.norm(hidden,
residual)`` on the inner text model, returning (normed, hidden + residual): read in the
llama, qwen2, qwen3, qwen3_moe (qwen2_moe before 0.5.2x) and deepseek_v2 sources of
sglang 0.5.9, 0.5.11, 0.5.15 and 0.5.23 (0.5.23 through
``layer_boundary.residual.batch.final_norm``). tests/test_sglang_conformance.py pins it."""


def find_final_norm(model: object) -> object | None:
    """The final norm module of a loaded SGLang model (the inner text model's ``norm``),
    where a forward hook sees its input; None when there is none (a non-last pipeline
    stage holds a PPMissingLayer)."""
    for path in ("model.norm", "language_model.model.norm"):
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if callable(getattr(obj, "register_forward_hook", None)) and (
            type(obj).__name__ != "PPMissingLayer"
        ):
            return obj
    return None
