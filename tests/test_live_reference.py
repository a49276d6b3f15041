"""The live test's reference forward (tests/gpu/reference.py) on a CPU: its own MoE block
equals transformers' DeepSeek-V3 MoE, and replaying expert choices does what it says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.gpu.reference import LAST, PRENORM, Reference  # noqa: E402

LAYERS, TOP_K, EXPERTS = 3, 2, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=1.0,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a router that is not flat, and experts that differ
        for module in model.modules():
            mod: Any = module
            if hasattr(mod, "e_score_correction_bias"):
                mod.weight.normal_(0, 0.5)
            if hasattr(mod, "gate_up_proj"):
                mod.gate_up_proj.normal_(0, 0.2)
                mod.down_proj.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("ds")
    model.save_pretrained(path)
    return path


def _transformers_states(path: Path, ids: list[int]) -> tuple[list[Any], list[Any]]:
    """HF's own hidden states and the experts each MoE gate chose, unpatched."""
    from transformers import AutoModelForCausalLM

    m: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.eval()
    chosen: list[Any] = []
    for layer in m.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
    with torch.inference_mode():
        out = m.model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], chosen


def test_free_routing_equals_transformers(model_dir: Path) -> None:
    ids = [1, 5, 9, 33, 7, 100, 2, 64]
    hf, _ = _transformers_states(model_dir, ids)
    ref = Reference(model_dir, "cpu")
    assert ref.moe_layers == [1, 2]
    got = ref.states(ids)
    for i in range(LAYERS):
        assert torch.allclose(got[i], hf[i], atol=1e-5), i
    assert torch.allclose(got[LAST], hf[LAYERS], atol=1e-5)  # HF's last entry is post-norm
    assert got[PRENORM].shape == got[LAST].shape


def test_replaying_the_servers_choice(model_dir: Path) -> None:
    ids = [1, 5, 9, 33, 7, 100, 2, 64]
    _, chosen = _transformers_states(model_dir, ids)
    ref = Reference(model_dir, "cpu")
    free = ref.states(ids)
    routing = torch.zeros(len(ids), LAYERS, TOP_K, dtype=torch.int32)
    for layer, c in zip(ref.moe_layers, chosen, strict=True):
        routing[:, layer, :] = c.to(torch.int32)
    same = ref.states(ids, routing.numpy())
    for k in free:
        assert torch.allclose(same[k], free[k], atol=1e-6), k
    other = routing.clone()
    other[3, 1, :] = torch.tensor([e for e in range(EXPERTS) if e not in routing[3, 1].tolist()])
    moved = ref.states(ids, other.numpy())
    assert torch.equal(moved[1], free[1])  # before the first MoE layer: untouched
    row = (moved[2] - free[2]).abs().amax(dim=-1)
    assert row[3] > 1e-3 and torch.all(row[:3] < 1e-5)  # that token moves; earlier ones do not
    with pytest.raises(ValueError, match="rows"):
        ref.states(ids, routing[:-1].numpy())
