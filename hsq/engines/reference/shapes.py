"""The reference server's named random-weight shapes and EAGLE-3's default aux layers, apart
from the model (no torch): `hsq run` reads a shape before it starts a server (the spool's
check at enqueue, hsq.node.plan.model_shape)."""

from __future__ import annotations

from typing import Any

from hsq.errors import ConfigError

TINY = "tiny"
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def eagle3_default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's rule, in HF hidden_states indexing: [2, L//2, L-3]."""
    return [2, num_layers // 2, num_layers - 3]


def shape_config(name: str) -> dict[str, Any]:
    """Named random-weight shapes for benchmarks ("llama-8b" is Llama-3-8B's shape)."""
    shapes: dict[str, dict[str, Any]] = {
        TINY: TINY_CONFIG,
        "llama-8b": {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 16384,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    }
    if name not in shapes:
        raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(shapes)}")
    return dict(shapes[name])
