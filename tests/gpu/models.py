"""Random-weight checkpoints the live tests serve, written with transformers on the GPU
machine (nothing is downloaded there): a Llama, a DeepSeek-V3 (MLA + MoE) and a Kimi-K2.5
whose text backbone is that DeepSeek-V3's exact weights."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

VOCAB = 32000
DEEPSEEK_LAYERS = 6
DEEPSEEK_FIRST_DENSE = 2  # aux id 2 (the input of layer 2) sees no routing
# What DeepSeek-V3's own config.json has and transformers 5's DeepseekV3Config does not
# write: without moe_layer_freq SGLang 0.5.15 fails building the model (AttributeError:
# 'DeepseekV3Config' object has no attribute 'moe_layer_freq', seen live 2026-12-01).
DEEPSEEK_EXTRA_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def _say(msg: str) -> None:
    print(f"[live] {msg}", flush=True)


def llama_config(**shape: Any) -> Any:
    """A LlamaConfig with the settings every test Llama shares, `shape` on top."""
    from transformers import LlamaConfig

    common: dict[str, Any] = {
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": False,
        "architectures": ["LlamaForCausalLM"],  # a config saved alone has none; SGLang needs it
    }
    return LlamaConfig(**{**common, **shape})


def write_llama(path: Path, *, layers: int, hidden: int, seed: int, device: str) -> Path:
    """A random-weight Llama saved by transformers (bf16 safetensors, config.json)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).bfloat16()
    model.save_pretrained(path, safe_serialization=True)
    _say(f"wrote {path.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params")
    return path


# Llama-3-8B's widths (bench/sglang_capacity.py serves the same with --load-format dummy).
LLAMA8B_SHAPE = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def write_llama8b_width(path: Path, *, layers: int, seed: int, device: str, context: int) -> Path:
    """Llama-3-8B's widths with `layers` decoder layers (8B has 32), random bf16 weights
    written for real, so a reference forward loads the very weights SGLang serves (the
    values of SGLang's dummy loader cannot be rebuilt outside it). A dump's and an output's
    bytes per token depend on the hidden size and the captured layers, not on the depth."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(num_hidden_layers=layers, max_position_embeddings=context, **LLAMA8B_SHAPE)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy on the GPU
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    model.save_pretrained(path, safe_serialization=True)
    _say(f"wrote {path.name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params")
    return path


def deepseek_config() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=DEEPSEEK_LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=DEEPSEEK_FIRST_DENSE,
        kv_lora_rank=512,
        q_lora_rank=768,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        routed_scaling_factor=1.0,
        max_position_embeddings=8192,
        rope_interleave=True,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def deepseek_state(seed: int, device: str) -> tuple[Any, dict[str, Any]]:
    """(config, state dict with DeepSeek's per-expert weight names) of a random model."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    cfg = deepseek_config()
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg).bfloat16()
        # Random routing biases would send every token to the same experts; spread them.
        for mod in model.modules():
            bias = getattr(mod, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.data.zero_()
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    return cfg, split_experts(state)


def split_experts(state: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps the experts fused ([E, 2I, H] gate_up, [E, H, I] down); SGLang
    loads DeepSeek's original per-expert names."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        fused = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", k)
        if fused is None:
            out[k] = v
            continue
        base = fused.group(1)
        for e in range(v.shape[0]):
            if fused.group(2) == "gate_up_proj":
                gate, up = v[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{base}.{e}.down_proj.weight"] = v[e].contiguous()
    return out


def write_deepseek(path: Path, *, seed: int, device: str) -> Path:
    """A tiny random DeepSeek-V3 (MLA attention, one dense layer then MoE layers)."""
    if (path / "model.safetensors").exists():
        return path
    from safetensors.torch import save_file

    cfg, state = deepseek_state(seed, device)
    path.mkdir(parents=True, exist_ok=True)
    cfg.architectures = ["DeepseekV3ForCausalLM"]  # model.save_pretrained would set it
    cfg.save_pretrained(path)
    _add_fields(path / "config.json", DEEPSEEK_EXTRA_FIELDS)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    _say(f"wrote {path.name}: {sum(v.numel() for v in state.values()) / 1e6:.0f}M params")
    return path


def _add_fields(config: Path, fields: dict[str, Any], key: str | None = None) -> None:
    data = json.loads(config.read_text())
    (data[key] if key else data).update(fields)
    config.write_text(json.dumps(data, indent=1))


def write_kimi(path: Path, deepseek: Path) -> Path:
    """A tiny KimiK25ForConditionalGeneration: the DeepSeek-V3 at `deepseek` as its text
    backbone (same tensors under `language_model.`), the smallest MoonViT the config takes
    (one layer, width 64) whose weights are left out: text-only requests never run it, and
    SGLang's loader leaves parameters the checkpoint lacks as they were allocated.

    SGLang builds a multimodal processor at start even with --skip-tokenizer-init
    (AutoProcessor on the model dir), so the dir also gets a processor made from
    transformers' own Kimi-K2.5 classes and a one-word tokenizer; the live test replaces
    SGLang's Kimi processor (which reads remote-code fields) with a text-only one
    (tests/gpu/kimi_mm, SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE)."""
    if (path / "model.safetensors").exists():
        return path
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    text = json.loads((deepseek / "config.json").read_text())
    for k in ("transformers_version", "dtype", "torch_dtype"):
        text.pop(k, None)
    # SGLang 0.5.15 reads text_config.architectures[0] while building the DeepSeek-V3
    # backbone (determine_num_fused_shared_experts): without it, TypeError 'NoneType'
    # object is not subscriptable (seen live 2026-12-01). Kimi-K2.5's own config has it.
    text["model_type"], text["architectures"] = "deepseek_v3", ["DeepseekV3ForCausalLM"]
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {
            "patch_size": 14,
            "init_pos_emb_height": 8,
            "init_pos_emb_width": 8,
            "init_pos_emb_time": 4,
            "pos_emb_type": "divided_fixed",
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 1,
            "vt_hidden_size": 64,
            "vt_intermediate_size": 128,
            "merge_kernel_size": [2, 2],
            "video_attn_type": "spatial_temporal",
            "merge_type": "sd2_tpool",
            "mm_projector_type": "patchmerger",
            "mm_hidden_size": 64,
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-5,
            "text_hidden_size": text["hidden_size"],
        },
        "media_placeholder_token_id": 31999,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _write_processor(path)
    state = load_file(str(deepseek / "model.safetensors"))
    save_file(  # last: its presence means the checkpoint is complete
        {f"language_model.{k}": v for k, v in state.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    _say(f"wrote {path.name}: {len(state)} text tensors under language_model.")
    return path


def _write_processor(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<|media_pad|>": 1, "<|kimi_k25_video_placeholder|>": 2}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment,unused-ignore]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")  # type: ignore[no-untyped-call,unused-ignore]
    try:
        from transformers.models.kimi_k25 import (  # type: ignore[attr-defined,unused-ignore]
            Kimi_K25ImageProcessor,
            Kimi_K25Processor,
            Kimi_K25VideoProcessor,
        )
    except ImportError:  # a transformers without Kimi-K2.5: AutoProcessor finds the tokenizer
        fast.save_pretrained(path)
        return
    Kimi_K25Processor(  # type: ignore[no-untyped-call,unused-ignore]
        image_processor=Kimi_K25ImageProcessor(),
        tokenizer=fast,
        video_processor=Kimi_K25VideoProcessor(),
    ).save_pretrained(path)
