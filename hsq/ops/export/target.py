"""What SpecForge needs from the target model besides the states, written from a local
checkpoint (`hsq export --target-model CKPT [--target-dir DIR]`).

- `--target-dir DIR` (SpecForge's `model.target_model_path`): `config.json`, the two
  tensors its offline trainer loads (`model.embed_tokens.weight`, `lm_head.weight`) in
  `model.safetensors`, and `model.safetensors.index.json`: SpecForge 0.2.0's `TargetHead`
  finds the LM head through a `*.index.json` and fails ("No index.json file found") on a
  lone `model.safetensors`. A tied LM head is written out as a copy of the embedding.
- `DEST/draft_config.json` (`model.draft_model_config`, and `--draft-config` of SpecForge's
  SGLang export): the EAGLE-3 draft config SpecForge would derive from the target, plus
  `eagle_config.eagle_aux_hidden_state_layer_ids` in SGLang's numbering for this target's
  family, so the served drafter captures the run's layers (SGLang reads only that key;
  without it it uses its default layers, whatever the drafter was trained on).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from hsq.errors import ConfigError
from hsq.fsio import write_durably

MAX_CONFIG_BYTES = 4 * 2**20
EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
DRAFT_CONFIG = "draft_config.json"
DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
DEFAULT_DRAFT_VOCAB = 32000
"""SpecForge 0.2.0's default draft vocabulary (capped at the target's)."""

# The target fields SpecForge 0.2.0 copies into a derived draft config
# (training/model_loading.py _TARGET_ARCHITECTURE_FIELDS), plus transformers 5's
# rope_parameters, which holds rope_theta there.
_TARGET_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "initializer_range",
    "attention_bias",
    "attention_dropout",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
)


def load_config(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / "config.json"
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--target-model {checkpoint}: cannot read config.json: {exc}") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return obj


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def check_run_matches(
    config: dict[str, Any], hidden_size: int | None, layers: list[int] | None
) -> None:
    """Refuse a checkpoint that is not the model the run extracted from (by shape)."""
    tc = text_config(config)
    h, n = tc.get("hidden_size"), tc.get("num_hidden_layers")
    if hidden_size is not None and h != hidden_size:
        raise ConfigError(
            f"--target-model has hidden_size {h}; the run's states have {hidden_size}"
        )
    if layers is not None and isinstance(n, int) and any(not 0 <= i < n for i in layers):
        raise ConfigError(f"the run's layers {layers} do not fit --target-model's {n} layers")


def sglang_layer_ids(config: dict[str, Any], layers: list[int]) -> list[int] | None:
    """The ids a drafter config must name for SGLang to capture HF `layers` on this target
    (docs/sglang.md#layer-ids); None where no id list can (or the family is unknown)."""
    from hsq.engines.sglang.layers import effective_layer_ids, family

    archs = config.get("architectures") or []
    fam = family(archs[0]) if archs and isinstance(archs[0], str) else None
    n = text_config(config).get("num_hidden_layers")
    if fam is None or not isinstance(n, int):
        return None
    ids = [i - 1 for i in layers] if fam == "llama" else list(layers)
    try:
        ok = min(ids) >= 0 and effective_layer_ids(fam, n, ids) == sorted(layers)
    except ValueError:
        ok = False
    return ids if ok else None


def draft_config(
    config: dict[str, Any], layers: list[int], draft_vocab_size: int | None
) -> tuple[dict[str, Any], list[int] | None]:
    """SpecForge's derived EAGLE-3 draft config with the run's layers in `eagle_config`."""
    tc = text_config(config)
    out: dict[str, Any] = {k: tc[k] for k in _TARGET_FIELDS if tc.get(k) is not None}
    vocab = int(tc["vocab_size"])
    out.update(
        architectures=[DRAFT_ARCHITECTURE],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        use_cache=True,
        draft_vocab_size=draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vocab),
    )
    out.setdefault("pad_token_id", 0)
    ids = sglang_layer_ids(config, layers)
    if ids is not None:
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
        }
    return out, ids


def write_draft_config(
    config: dict[str, Any], dest: Path, layers: list[int], draft_vocab_size: int | None
) -> tuple[Path, list[int] | None]:
    obj, ids = draft_config(config, layers, draft_vocab_size)
    data = (json.dumps(obj, indent=2) + "\n").encode()
    path = dest / DRAFT_CONFIG
    write_durably(path, lambda fd: os.write(fd, data))
    return path, ids


def _find_key(names: list[str], want: str, suffix: str) -> str | None:
    if want in names:
        return want
    hits = [n for n in names if n.endswith(suffix)]
    return hits[0] if len(hits) == 1 else None


def _tensor_files(checkpoint: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    indexes = sorted(checkpoint.glob("*.safetensors.index.json"))
    if indexes:
        try:
            wm = json.loads(indexes[0].read_text()).get("weight_map", {})
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{indexes[0]}: {exc}") from exc
        return {str(k): checkpoint / Path(str(v)).name for k, v in wm.items() if isinstance(v, str)}
    out: dict[str, Path] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update(dict.fromkeys(st.keys(), f))
    if not out:
        raise ConfigError(f"--target-model {checkpoint}: no *.safetensors weights")
    return out


def _refuse_the_checkpoint(checkpoint: Path, target_dir: Path) -> None:
    """ConfigError if target_dir is (or, once made, would be) the checkpoint's directory.

    Compared by identity (device and inode), not by resolved paths: a bind mount, a second
    mount of the same filesystem resolves to another path, and a check by path let an
    export through such an alias replace the checkpoint's own weights.
    A target that does not exist yet is a new directory, unless the part still to be made
    climbs back up with `..`: refused, since what it names is known only after mkdir."""
    ckpt = os.stat(checkpoint)
    made = []
    here = target_dir
    while True:
        try:
            st = os.stat(here)
            break
        except FileNotFoundError:
            if here.parent == here:
                return
            made.append(here.name)
            here = here.parent
    if ".." in made:
        raise ConfigError(f"--target-dir {target_dir}: give it without `..` in the part to make")
    if not made and (st.st_dev, st.st_ino) == (ckpt.st_dev, ckpt.st_ino):
        raise ConfigError(
            f"--target-dir {target_dir} is the checkpoint --target-model {checkpoint} (the "
            "same directory by device and inode): it would replace the checkpoint's weights"
        )


def write_target_dir(checkpoint: Path, target_dir: Path) -> list[str]:
    """Write SpecForge's target dir from a local HF checkpoint; returns the files written."""
    from safetensors import safe_open
    from safetensors.torch import save

    _refuse_the_checkpoint(checkpoint, target_dir)
    config = load_config(checkpoint)
    files = _tensor_files(checkpoint)
    names = sorted(files)
    embed = _find_key(names, EMBED_KEY, "embed_tokens.weight")
    head = _find_key(names, LM_HEAD_KEY, "lm_head.weight")
    tied = bool(text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings")))
    if embed is None or (head is None and not tied):
        raise ConfigError(
            f"--target-model {checkpoint}: no unique embedding / LM head tensor "
            f"(looked for {EMBED_KEY} and {LM_HEAD_KEY}; a tied head needs tie_word_embeddings)"
        )

    def load(name: str) -> Any:
        with safe_open(str(files[name]), framework="pt") as st:
            return st.get_tensor(name).contiguous()

    e = load(embed)
    tensors = {EMBED_KEY: e, LM_HEAD_KEY: load(head) if head is not None else e.clone()}
    target_dir.mkdir(parents=True, exist_ok=True)
    others = [
        p.name for p in target_dir.glob("*.index.json") if p.name != "model.safetensors.index.json"
    ]
    if others:
        raise ConfigError(f"{target_dir} holds other index files {others}: SpecForge needs one")
    blob = save(tensors, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {k: "model.safetensors" for k in tensors},
    }
    outputs = {
        "config.json": (checkpoint / "config.json").read_bytes(),
        "model.safetensors": blob,
        "model.safetensors.index.json": (json.dumps(index, indent=2) + "\n").encode(),
    }
    for name, data in outputs.items():
        write_durably(target_dir / name, functools.partial(_write_all, data=data))
    return sorted(outputs)


def _write_all(fd: int, *, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
