"""Train while extracting on one GPU: `hsq run --engine sglang --spool-budget` and a
trainer taking real optimizer steps on the same GPU (tests/gpu/streamgpu.py). Every sample
trained exactly once, the spool never above its budget plus one file (watched on disk all
through), every file removed once committed, `hsq run` exit 0; the results give the
trainer's data-wait share (high: extraction is the limit), the spool's peak and the run's
summary.

    scripts/sglang_live.sh --job stream="tests/gpu/test_sglang_stream.py"
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsq.node.procs import hsq_command
from tests.gpu import models_fixture as mf
from tests.gpu.extract import make_dataset
from tests.gpu.models import VOCAB
from tests.gpu.results import Results
from tests.run_helpers import Watch
from tests.support.sglang import SGLANG_FLAGS, wait_for

SAMPLES = 64
BUDGET_MIB = 64
"""About 4 samples of the mix below (Llama hidden 2048: 16 KiB a token, 16-2000 tokens)."""


def test_stream_with_a_gpu_trainer(
    results: Results, models_root: Path, fresh: tuple[Path, Path]
) -> None:
    model = mf.llama(models_root)
    wd, _ = fresh
    engine = ["--engine", "sglang", "--gpus", "0", "--model", str(model.served)]
    server = ["--layers", model.layers, "--mem-fraction-static", "0.12", *SGLANG_FLAGS]
    fig = run_stream(wd, engine, server, "cuda", VOCAB)
    results.record("stream", **fig)
    assert fig["exit"] == 0 and fig["trainer_exit"] == 0, fig
    assert fig["trained_once"], fig["trained"]  # every sample trained once
    assert 0 < fig["spool_peak_on_disk"] <= fig["budget"] + fig["largest_file"], fig
    assert fig["left_on_disk"] == 0  # every file removed once committed


def run_stream(
    wd: Path, engine: Sequence[str], server: Sequence[str], device: str, vocab: int
) -> dict[str, Any]:
    """One streamed `hsq run` with the GPU trainer beside it; its figures."""
    ds = wd / "data.jsonl"
    data = make_dataset(ds, [16 + (i * 613) % 1985 for i in range(SAMPLES)], vocab=vocab, seed=9)
    out = wd / "out"
    argv = hsq_command(
        "--log-format", "json", "run", str(ds), "--run", "data", "--out", str(out), *engine,
        "--json", "--spool-budget", f"{BUDGET_MIB}M", "--", *server,
    )  # fmt: skip
    watch = Watch(out / "data")
    procs: list[subprocess.Popen[bytes]] = []
    trainer_log = wd / "trainer.log"
    url_file = out / ".hsq" / "redis-url"
    rc = rc_trainer = -1
    try:
        with open(wd / "run.stdout", "wb") as so, open(wd / "run.stderr", "wb") as se:
            procs.append(subprocess.Popen(argv, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                          start_new_session=True))  # fmt: skip
        wait_for(url_file.exists, 600, "hsq run's Redis")
        with open(trainer_log, "wb") as tl:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.gpu.streamgpu", "--run", "data",
                 "--redis-url-file", str(url_file), "--device", device],
                stdout=tl, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            ))  # fmt: skip
        rc_trainer = procs[1].wait(1200)
        rc = procs[0].wait(300)
    finally:
        watch.stop()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
    lines = (wd / "run.stdout").read_text().splitlines()
    objs = [x for x in lines if x.startswith("{")]
    got = [x for x in trainer_log.read_text().splitlines() if x.startswith("{")]
    trainer = json.loads(got[-1]) if got else {}
    trained = trainer.get("trained", [])
    return {
        "exit": rc, "trainer_exit": rc_trainer, "budget": BUDGET_MIB * 2**20,
        "spool_peak_on_disk": watch.peak_disk, "largest_file": watch.largest,
        "output_bytes": sum(watch.sizes.values()), "trained": len(trained),
        "trained_once": Counter(trained) == Counter(list(data)),
        "trainer_step_s": trainer.get("step_s"), "trainer_wait": trainer.get("wait"),
        "left_on_disk": len(list((out / "data").rglob("*.safetensors"))),
        "summary": json.loads(objs[-1]) if objs else {},
        "view": [x for x in lines if x.startswith("progress")][-5:],
        "trainer_log_tail": trainer_log.read_text().splitlines()[-10:] if rc_trainer else [],
    }  # fmt: skip
