"""`hsq run --engine sglang` end to end on one GPU: its own Redis, one SGLang server through
`hsq launch-sglang`, one worker, every output verified.

    scripts/sglang_live.sh --job run="tests/gpu/test_sglang_run.py"
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from hsq.node.procs import hsq_command
from tests.gpu import models_fixture as mf
from tests.gpu.extract import make_dataset
from tests.gpu.models import VOCAB
from tests.gpu.results import Results
from tests.support.sglang import SGLANG_FLAGS

SAMPLES = 48


def test_hsq_run_with_sglang_on_one_gpu(
    results: Results, models_root: Path, fresh: tuple[Path, Path]
) -> None:
    model = mf.llama(models_root)
    wd, _ = fresh
    ds = wd / "data.jsonl"
    make_dataset(ds, [16 + 40 * i for i in range(SAMPLES)], vocab=VOCAB, seed=5)
    out = wd / "out"
    argv = hsq_command(
        "--log-format", "json", "run", str(ds), "--out", str(out), "--engine", "sglang",
        "--gpus", "0", "--model", str(model.served), "--json", "--verify",
        "--", "--layers", model.layers, "--mem-fraction-static", "0.12", *SGLANG_FLAGS,
    )  # fmt: skip
    t = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    seconds = round(time.monotonic() - t, 1)
    (wd / "run.stdout").write_text(r.stdout)
    (wd / "run.stderr").write_text(r.stderr)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    summary = json.loads(lines[-1]) if lines else {}
    view = [x for x in r.stdout.splitlines() if x.startswith("progress")]
    results.record(
        "hsq_run", exit=r.returncode, seconds=seconds, summary=summary, view=view[-5:],
        # What a user reads while SGLang loads and compiles (the lines to quote): every
        # line up to the first sample done, at most 12 of them.
        view_start=[x for x in view if " done=0/" in x][:12],
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"]["done"] == SAMPLES and summary["status"]["dead"] == 0
    assert summary["verified"] == {"checked": SAMPLES, "ok": SAMPLES, "problems": 0}
    logs = sorted((out / ".hsq" / "logs").glob("server-*.log"))
    assert [p.name for p in logs] == ["server-0.log"]  # one GPU, TP 1: one server
