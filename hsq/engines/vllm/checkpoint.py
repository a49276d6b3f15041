"""The final RMSNorm, read from the checkpoint: vLLM hands the connector the state before
the norm (aux id L), and hsq's dump also holds the state after it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsq.errors import ConfigError

if TYPE_CHECKING:
    import torch

NORM_NAMES = (
    "model.norm.weight",
    "language_model.model.norm.weight",
    "model.language_model.norm.weight",
)
"""Where the final norm's weight is in the checkpoint families of layers.FAMILIES."""
_MAX_JSON = 64 * 2**20


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor
    """[H], in the checkpoint's dtype."""
    eps: float

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The norm as HF's LlamaRMSNorm and vLLM's RMSNorm.forward_native compute it:
        float32 statistics, cast back to x's dtype, then times the weight."""
        import torch

        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


def _json(path: Path) -> Any:
    with open(path, "rb") as f:
        data = f.read(_MAX_JSON + 1)
    if len(data) > _MAX_JSON:
        raise ConfigError(f"{path} is over {_MAX_JSON} bytes")
    return json.loads(data)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def read_final_norm(model_dir: Path, hidden_size: int) -> FinalNorm:
    """The final norm's weight and eps of a local checkpoint directory (ConfigError when
    it is not one, or holds no such weight)."""
    from safetensors import safe_open

    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"{model_dir} is not a local checkpoint directory: the post-norm state needs "
            "the final norm's weight (serve a directory, or set hsq_model_path)"
        )
    config = _text_config(_json(model_dir / "config.json"))
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ConfigError(f"{model_dir}/config.json has no usable rms_norm_eps: {eps!r}")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map", {})
        files = [(n, weight_map[n]) for n in NORM_NAMES if isinstance(weight_map.get(n), str)]
    else:
        files = [(n, "model.safetensors") for n in NORM_NAMES]
    for name, file in files:
        path = model_dir / Path(file).name  # a name, never a path out of the checkpoint
        if not path.is_file():
            continue
        with safe_open(str(path), framework="pt") as f:
            if name not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                continue
            weight = f.get_tensor(name)
        if list(weight.shape) != [hidden_size]:
            raise ConfigError(f"{name} is {list(weight.shape)}, expected [{hidden_size}]")
        return FinalNorm(weight, float(eps))
    raise ConfigError(f"no final norm weight ({', '.join(NORM_NAMES)}) in {model_dir}")
