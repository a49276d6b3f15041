"""SpecForge 0.2.0's own trainer learns from hsq's export, on a CPU.

Real processes all the way: chat rows -> `hsq tokenize` -> the reference server serving a
tiny seeded checkpoint with an LM head (tests.support.tinymodel), dumping float32 states with
non-default layers -> `hsq worker` -> `hsq export --format specforge --target-model
--target-dir` -> `specforge train` for 200 steps with a held-out set it evaluates every 10
steps -> `specforge export --to sglang` of the drafter.

Checked: the held-out loss falls and the held-out accuracy rises (a learning check, on a
fixed held-out set: SpecForge's logged per-step ploss divides by all positions, so it moves
with each sample's masked fraction); the float32 run trains (export casts to bf16); the run's
layers reach the served drafter's config.

One substitution, on purpose: SpecForge's loss is a CUDA-only Triton kernel, so the run
goes through tests.support.specforge_cpu, which monkeypatches it with SpecForge's own
reference loss (`specforge.core.loss._compute_loss`). Everything else is SpecForge's.

SpecForge runs in a venv of its own, with its own pin of transformers (5.8.1; hsq's is
5.24.0), as docs/training.md says a trainer lives beside hsq (tests.support.specforge_venv).
Only the export on disk passes between the two: the trainer here imports nothing of hsq
(tests.support.specforge_cpu imports nothing but SpecForge).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsq.engines.sglang.layers import effective_layer_ids
from hsq.node.procs import RedisServer
from tests.helpers import hsq, start_worker
from tests.support.learnchats import chats
from tests.support.procs import ReferenceServer
from tests.support.specforge_venv import specforge_python, trainer_env

pytestmark = [pytest.mark.trainer, pytest.mark.timeout(1800)]

Factory = Callable[..., ReferenceServer]

LAYERS = [1, 3, 6]
"""Non-default HF layers (the tiny model's default is [2, 4, 5]): SGLang numbering [0, 2, 5]."""
TRAIN, HELDOUT = 64, 8
STEPS, EVAL_EVERY = 200, 10


def specforge_config(base: Path) -> dict[str, Any]:
    """Every key a CPU run needs (docs/training.md shows the same for a GPU)."""
    return {
        "model": {
            "target_model_path": str(base / "target"),
            "draft_model_config": str(base / "sf-train" / "draft_config.json"),
        },
        "data": {
            "hidden_states_path": str(base / "sf-train"),
            "eval_hidden_states_path": str(base / "sf-heldout"),
            "max_length": 512,
            "cache_dir": str(base / "sf-cache"),
        },
        "training": {
            "strategy": "eagle3",
            "fsdp_sharding": "NO_SHARD",  # one process, no sharding
            "attention_backend": "sdpa",  # flex_attention / fa need a GPU
            "max_steps": STEPS,
            "num_epochs": 10,
            "batch_size": 1,
            "learning_rate": 3e-3,
            "lr_scheduler": "constant",
            "warmup_ratio": 0.0,
            "ttt_length": 3,
            "eval_interval": EVAL_EVERY,
            "log_interval": 50,
        },
        "output_dir": str(base / "sf-out"),
    }


def held_out_evals(log: str) -> list[tuple[int, dict[str, Any]]]:
    """SpecForge's eval lines: `step N: {'eval/avg_loss': ..., ...}` (a Python literal)."""
    out = []
    for m in re.finditer(r"^step (\d+): (\{'eval/.*\})$", log, re.MULTILINE):
        out.append((int(m.group(1)), ast.literal_eval(m.group(2))))
    return out


def test_specforge_trains_on_hsqs_export_and_the_drafter_gets_the_runs_layers(
    tmp_path: Path, server_factory: Factory, redis_server: RedisServer
) -> None:
    base, url = tmp_path, redis_server.url
    py = sys.executable
    trainer = str(specforge_python())
    pins = subprocess.run(
        [trainer, "-c", "import transformers, specforge.cli; print(transformers.__version__)"],
        capture_output=True, text=True, env=trainer_env(),
    )  # fmt: skip
    assert pins.returncode == 0, f"the trainer venv cannot import specforge:\n{pins.stderr}"
    assert pins.stdout.strip() == "5.8.1"  # SpecForge's pin, not hsq's
    subprocess.run([py, "-m", "tests.support.toytok", str(base / "tok")], check=True)
    subprocess.run([py, "-m", "tests.support.tinymodel", str(base / "model")], check=True)
    src = base / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chats(TRAIN + HELDOUT)))
    tok = ["--tokenizer", str(base / "tok"), "-o", str(base / "tokens.jsonl"), "--no-progress"]
    hsq("tokenize", str(src), *tok, check=True)
    rows = (base / "tokens.jsonl").read_text().splitlines(keepends=True)
    assert len(rows) == TRAIN + HELDOUT
    (base / "train.jsonl").write_text("".join(rows[:TRAIN]))
    (base / "heldout.jsonl").write_text("".join(rows[TRAIN:]))

    layers = ",".join(map(str, LAYERS))
    model_args = ["--model", str(base / "model"), "--dump-dtype", "float32", "--layers", layers]
    srv = server_factory(*model_args, name="learnsrv").wait_ready()
    for run, data in (("learn", "train.jsonl"), ("learn-heldout", "heldout.jsonl")):
        enq = ["enqueue", str(base / data), "--run", run, "--out", str(base / "out")]
        hsq(*enq, "--redis", url, "--no-progress", check=True)
        w = start_worker(base, run, srv, url, "--burst", name=f"w-{run}")
        try:
            assert w.proc.wait(300) == 0, w.log_tail()
        finally:
            w.stop()
    srv.stop()

    export = ["export", "--redis", url, "--format", "specforge", "--no-progress"]
    target = ["--target-model", str(base / "model"), "--target-dir", str(base / "target")]
    res = hsq(*export, "--run", "learn", "--to", str(base / "sf-train"), *target, check=True)
    assert "float32 states written as bfloat16" in res.stdout
    assert "eagle_aux_hidden_state_layer_ids [0, 2, 5]" in res.stdout
    hsq(*export, "--run", "learn-heldout", "--to", str(base / "sf-heldout"), check=True)
    assert sorted(p.name for p in (base / "target").iterdir()) == [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]

    cfg = base / "cfg.json"
    cfg.write_text(json.dumps(specforge_config(base), indent=2))
    log = base / "specforge.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [trainer, "-m", "tests.support.specforge_cpu", "train", "--config", str(cfg)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
            cwd=base,
            env=trainer_env(),
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    evals = held_out_evals(text)
    assert [s for s, _ in evals] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)), text[-3000:]
    (s0, first), (s1, last) = evals[0], evals[-1]
    print(
        f"held-out: step {s0} loss {first['eval/ploss_0']:.3f} acc {first['eval/avg_acc']:.3f} "
        f"-> step {s1} loss {last['eval/ploss_0']:.3f} acc {last['eval/avg_acc']:.3f} "
        f"(simulated acceptance length {first['eval/simulated_acc_len']:.3f} -> "
        f"{last['eval/simulated_acc_len']:.3f})"
    )
    assert last["eval/ploss_0"] < first["eval/ploss_0"]
    assert last["eval/avg_acc"] > first["eval/avg_acc"]

    # SpecForge's own SGLang export, with the draft config hsq wrote: the served drafter
    # names the run's layers, and SGLang's rule for Llama maps them back to exactly those.
    drafter = base / "drafter"
    subprocess.run(
        [
            str(Path(trainer).parent / "specforge"),
            "export",
            "--to",
            "sglang",
            "--checkpoint",
            str(base / "sf-out" / "specforge-run-best"),
            "--draft-config",
            str(base / "sf-train" / "draft_config.json"),
            "--output-dir",
            str(drafter),
        ],
        check=True,
        capture_output=True,
        env=trainer_env(),
    )
    served = json.loads((drafter / "config.json").read_text())
    ids = served["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [0, 2, 5]
    assert effective_layer_ids("llama", 8, ids) == LAYERS
