"""The trainer venv of the tests that run SpecForge (tests/test_specforge_train.py, the
offline path; tests/test_stream_train.py, the streamed one): scripts/specforge_venv.sh makes
it in .cache/specforge-venv (minutes, once; made again when the script's commands change).
SpecForge's own pin of transformers (5.8.1; hsq's is 5.24.0), as docs/training.md says a
trainer lives beside hsq, and hsq's base install for the stream reader."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "specforge_venv.sh"
VENV = ROOT / ".cache" / "specforge-venv"


def specforge_python() -> Path:
    """The trainer venv's interpreter, made (or made again) by scripts/specforge_venv.sh."""
    stamp = VENV / "made-by.sha256"
    commands = [ln for ln in SCRIPT.read_text().splitlines() if not ln.startswith("#")]
    want = hashlib.sha256("\n".join(commands).encode()).hexdigest()  # comments do not count
    python = VENV / "bin" / "python"
    if not (python.exists() and stamp.exists() and stamp.read_text() == want):
        proc = subprocess.run([str(SCRIPT), str(VENV)], capture_output=True, text=True)
        if proc.returncode != 0:
            why = f"scripts/specforge_venv.sh failed:\n{proc.stdout}\n{proc.stderr}"
            if os.environ.get("CI"):  # CI must run the trainer, not skip it
                pytest.fail(why)
            pytest.skip(why)
        stamp.write_text(want)
    return python


def trainer_env() -> dict[str, str]:
    """The trainer venv's environment: this checkout's hsq first (the venv's editable
    install points at the checkout that made it), nothing of .venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = str(ROOT)
    return env
