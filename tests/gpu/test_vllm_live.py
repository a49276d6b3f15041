"""The vLLM live check as pytest, beside SGLang's: scripts/vllm_live.sh's phases against
the vLLM installed here (skipped without vLLM or CUDA; the GPU machine without a registry
runs the script itself from its bundle, the same checks).

    pytest -m gpu tests/gpu/test_vllm_live.py        # HSQ_LIVE_RESULTS=FILE keeps the figures

tiny: a small random Llama through `hsq launch-vllm`, dumps equal to a float32 forward, a
worker run, a SIGKILL of vLLM mid-run and every sample done, capacity with and without the
connector. 8b: Llama-3-8B's config with dummy weights: plain vLLM at its best in-flight
count, the connector at that count, `hsq worker` end to end, `hsq verify --deep` (the
ratios are figures, never asserted: speed belongs in bench/).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.gpu.results import Results

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape", ["tiny", "8b"])
def test_vllm_live(shape: str, tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "WORK": str(tmp_path / "work")}
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm_live.sh"), "--shape", shape, "--results", str(out)],
        capture_output=True, text=True, timeout=3000, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    packed = out / "summary.json"
    summary = json.loads(packed.read_text()) if packed.exists() else {}
    path = os.environ.get("HSQ_LIVE_RESULTS")
    Results(Path(path) if path else None).record(f"vllm_{shape}", exit=r.returncode, **summary)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if shape == "tiny":
        assert summary["one"]["ok"], summary["one"]
        for run in ("w", "r"):
            assert summary[f"outputs-{run}"]["ok"], summary[f"outputs-{run}"]
        restart = summary["restart-worker"]
        assert restart["worker_exit"] == 0 and restart["killed_mid_run"], restart
    else:
        v = summary["verify-w"]
        assert v["verify_deep_exit"] == 0 and v["done"] == v["samples"], v
        assert "connector_over_plain" in summary["ratios"], summary["ratios"]
