"""`specforge` (SpecForge 0.2.0's CLI) on a machine without a GPU.

SpecForge's EAGLE-3 loss is a Triton kernel (`specforge.core.loss.LogSoftmaxLoss`), which
runs on CUDA only. This launcher puts SpecForge's own reference loss in its place
(`specforge.core.loss._compute_loss`, the uncompiled function: the same value, computed by
PyTorch), then runs SpecForge's CLI unchanged. Everything else is SpecForge's; its config
needs `training.fsdp_sharding: NO_SHARD` and `training.attention_backend: sdpa` on a CPU.

    python -m tests.support.specforge_cpu train --config cfg.yaml
"""

from __future__ import annotations

import sys
from typing import Any


def use_reference_loss() -> None:
    import specforge.algorithms.eagle3.model as eagle3_model
    import specforge.core.loss as loss

    reference = getattr(loss._compute_loss, "__wrapped__", loss._compute_loss)

    class ReferenceLoss:
        """`LogSoftmaxLoss.apply`'s signature over the reference implementation."""

        @staticmethod
        def apply(logits: Any, target_p: Any, position_mask: Any) -> Any:
            return reference(logits, target_p, position_mask)

    loss.LogSoftmaxLoss = ReferenceLoss
    eagle3_model.LogSoftmaxLoss = ReferenceLoss


def main() -> None:
    use_reference_loss()
    from specforge.cli import main as specforge_main

    sys.exit(specforge_main())


if __name__ == "__main__":
    main()
