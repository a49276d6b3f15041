"""Layer ids: hsq's convention against vLLM's extract_hidden_states (read in vLLM 0.26.0).

hsq names a layer by HF ``hidden_states[i]``: the residual stream entering decoder layer
``i`` (0 is the embeddings). vLLM's aux id ``i < L`` is the same stream (Llama/Qwen2:
``hidden_states + residual`` after decoder layer ``i-1``, models/llama.py:419-428; DeepSeek
at the input of layer ``i``, models/deepseek_v2.py:1468-1475), and id ``L`` (the number of
layers) is the final state **before** the norm, where HF's ``hidden_states[L]`` is after it.
So a run's aux layers are asked for as they are, and ``L`` is always added: the dump's
``last_hidden_state`` is the norm applied to it, and its pre-norm state is that row itself.

vLLM returns the rows in ascending id order whatever the list's order (appended while it
walks the layers), and a repeated id makes the list longer than the rows: the ids sent to
vLLM are sorted and unique, and ``aux_rows`` maps them back to the run's order.
"""

from __future__ import annotations

from collections.abc import Sequence

LLAMA, QWEN, DEEPSEEK = "llama", "qwen", "deepseek"
FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": QWEN,
    "Qwen3ForCausalLM": QWEN,
    "DeepseekV2ForCausalLM": DEEPSEEK,
    "DeepseekV3ForCausalLM": DEEPSEEK,
}
"""Architectures whose capture points and final RMSNorm (``model.norm``, weight times the
normalized state) were read in vLLM's source. Others are refused: the post-norm state
would be computed with a norm hsq has not checked."""


def family(architecture: str) -> str | None:
    return FAMILIES.get(architecture)


def vllm_aux_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The ids for ``eagle_aux_hidden_state_layer_ids``: the run's layers plus ``L`` (the
    pre-norm final state), sorted and unique as vLLM returns them."""
    return sorted({*layer_ids, num_layers})


def aux_rows(layer_ids: Sequence[int], captured: Sequence[int]) -> list[int]:
    """Index into vLLM's ``[T, k, H]`` rows of each run layer, in the run's order."""
    where = {layer: i for i, layer in enumerate(captured)}
    return [where[i] for i in layer_ids]


def layer_problems(layer_ids: Sequence[int], num_layers: int, architecture: str) -> list[str]:
    """What makes these run layers impossible to dump from this model (empty: fine)."""
    problems: list[str] = []
    fam = family(architecture)
    if fam is None:
        problems.append(
            f"{architecture} is not a model family whose capture points and final norm hsq "
            f"has read in vLLM's source ({', '.join(sorted(FAMILIES))})"
        )
    past = [i for i in layer_ids if i >= num_layers]
    if past:
        problems.append(
            f"layer ids {past} are past the model's {num_layers} layers (hsq's ids are HF "
            f"hidden_states indices < {num_layers}; the final state is dumped anyway)"
        )
    if fam == DEEPSEEK and 0 in layer_ids:
        # deepseek_v2.py:1430 and 1468-1475: the residual is None entering layer 0 and
        # the capture adds it (TypeError in the forward).
        problems.append("layer id 0 (the embeddings) cannot be captured from DeepSeek in vLLM")
    return problems


def check_captured(captured: Sequence[int], layer_ids: Sequence[int], num_layers: int) -> list[str]:
    """The ids vLLM was told to capture (--speculative-config) against the run's."""
    want = vllm_aux_ids(layer_ids, num_layers)
    if list(captured) != want:
        return [
            f"--speculative-config captures {list(captured)}; layers {list(layer_ids)} "
            f"need exactly {want} (sorted, unique, with {num_layers} for the final state)"
        ]
    return []
