"""The ModelIdentity a dump carries, from the values vLLM's ModelConfig holds.

The digest is the one hsq's SGLang hook takes (hsq/engines/sglang/identity.py:
sha256 of the HF config dict as sorted JSON); services import no other service, so the
three lines are repeated here rather than shared."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from hsq.dump.format import ModelIdentity


def model_identity(
    model_path: str, architecture: str, num_layers: int, hidden_size: int, config: Mapping[str, Any]
) -> ModelIdentity:
    blob = json.dumps(dict(config), sort_keys=True, default=str)
    return ModelIdentity(
        name=PurePath(model_path.rstrip("/")).name or model_path,
        architecture=architecture,
        num_layers=int(num_layers),
        hidden_size=int(hidden_size),
        config_digest=hashlib.sha256(blob.encode()).hexdigest(),
    )
