"""The ModelIdentity a dump carries, from the values SGLang's ModelConfig holds."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from hsq.dump.format import ModelIdentity


def config_digest(config: Mapping[str, Any]) -> str:
    """sha256 of the HF config dict as sorted JSON: the digest the reference server uses
    for a local checkpoint (hsq/engines/reference/model.py), so both agree."""
    blob = json.dumps(dict(config), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def model_identity(
    model_path: str,
    architecture: str,
    num_layers: int,
    hidden_size: int,
    config: Mapping[str, Any],
) -> ModelIdentity:
    return ModelIdentity(
        name=PurePath(model_path.rstrip("/")).name or model_path,
        architecture=architecture,
        num_layers=int(num_layers),
        hidden_size=int(hidden_size),
        config_digest=config_digest(config),
    )
