"""The live models, written once per models dir (HSQ_LIVE_WORK/models) and shared by the
tests of a run; `python -m tests.gpu.models_fixture DIR` writes them all up front, so
parallel test processes never write the same checkpoint at once."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.gpu import models as m
from tests.gpu.phase import Model

LLAMA_LAYERS, LLAMA_HIDDEN = 8, 2048


def llama(root: Path, device: str = "cuda") -> Model:
    path = m.write_llama(root / "llama", layers=LLAMA_LAYERS, hidden=LLAMA_HIDDEN, seed=0,
                         device=device)  # fmt: skip
    return Model("llama", path, path, "llama", LLAMA_LAYERS, "1,3,5")


def deepseek(root: Path, device: str = "cuda") -> Model:
    path = m.write_deepseek(root / "deepseek", seed=0, device=device)
    # First id 1: DeepSeek's rule adds 1 to each (sglang >= 0.5.13): effective [2, 3, 5].
    return Model("deepseek", path, path, "deepseek", m.DEEPSEEK_LAYERS, "1,2,4", moe_top_k=2,
                 dense_layers=m.DEEPSEEK_FIRST_DENSE)  # fmt: skip


def kimi(root: Path, device: str = "cuda") -> Model:
    text = m.write_deepseek(root / "deepseek", seed=0, device=device)
    path = m.write_kimi(root / "kimi", text)
    env = {"SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE": "tests.gpu.kimi_mm"}
    # First id not 1: as given, effective [2, 3, 5] again, so it is the other branch of
    # the rule that picks the same layers.
    return Model("kimi", path, text, "deepseek", m.DEEPSEEK_LAYERS, "2,3,5", 2, env,
                 dense_layers=m.DEEPSEEK_FIRST_DENSE)  # fmt: skip


if __name__ == "__main__":
    # Each model on its own: one that cannot be written fails its own tests, not all.
    root = Path(sys.argv[1])
    for build in (llama, deepseek, kimi):
        try:
            print(build(root))
        except Exception as exc:  # reported; the test of that model fails with it again
            print(f"{build.__name__}: {type(exc).__name__}: {exc}", file=sys.stderr)
