"""A real EAGLE-3 drafter learns from hsq's stream, killed with SIGKILL once and resumed.

Real processes all the way: chat rows -> `hsq run --tokenizer --spool-budget` (its own
redis-server, the reference server serving the tiny seeded checkpoint with an LM head,
tests.support.tinymodel, a worker) -> examples/train_eagle3_from_stream.py in SpecForge's
venv (SpecForge 0.2.0's draft model, EAGLE-3 training model, step, loss, optimizer and
evaluator, in the example's own loop: a checkpoint, then a commit, every few steps). The
held-out set is a finished run of other chats from the same generator, extracted first
without a stream and read in place (hsq.data.HiddenStateDataset), as the offline test
(tests/test_specforge_train.py) holds one out.

The trainer is killed with SIGKILL (its process group) once mid-stream, after a checkpoint
and a few steps past it, and started again with the same command. Checked:
- every sample trained exactly once into the final model: the final checkpoint's ids are
  the dataset's, each once; the steps the killed life made after its last checkpoint are
  delivered again to the new life first, the same ids in the same order;
- held-out accuracy rises and held-out loss falls (SpecForge's `eval/avg_acc` and
  `eval/ploss_0` on the fixed held-out set: before the first step, and at the end);
- `specforge export --to sglang` reads the final checkpoint, and the served drafter's
  config names the run's layers (HF [1, 3, 6], SGLang's [0, 2, 5]);
- the spool never above its budget plus one file (watched on disk all through), every file
  removed once committed, `hsq run` exits 0 once everything is committed.

And a budget below the checkpoint interval (a deadlock by construction): said on both
sides, and a restart with a smaller interval gets out.

The example trainer runs on a CPU with SpecForge's reference loss in place of its CUDA-only
Triton kernel (the example does this itself when there is no CUDA). Waits for events,
never for time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import wait_until
from tests.run_helpers import Node, Watch, no_node_left
from tests.support.learnchats import chats
from tests.support.specforge_venv import ROOT, specforge_python, trainer_env
from tests.support.trainers import start_trainer

pytestmark = [
    pytest.mark.trainer,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(sys.platform != "linux", reason="process groups"),
    pytest.mark.usefixtures("no_trainer_left", no_node_left.__name__),
]

EXAMPLE = ROOT / "examples" / "train_eagle3_from_stream.py"
TRAIN, HELDOUT = 200, 8
EVERY = 4
"""Steps between checkpoints (each followed by a commit)."""
BUDGET_K = 640
"""About eight samples' worth (the tiny model's bf16 outputs of these chats are 78 KB on
average, 112 KB at most), a twenty-fourth of the run's outputs. It must hold a checkpoint
interval of samples: the trainer commits nothing before its next checkpoint, and no
sample is extracted while the spool is full (with EVERY = 8 this budget deadlocked, as
docs/training.md's sizing rule says it must)."""
LAYERS = "1,3,6"


def events(log: Path) -> list[dict[str, Any]]:
    """The example's JSON lines (hsq's own log lines are not JSON objects)."""
    out = []
    for line in log.read_text().splitlines():
        if line.startswith('{"event"'):
            with contextlib.suppress(ValueError):  # a killed life's last line, cut short
                out.append(json.loads(line))
    return out


def of(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["event"] == kind]


class Trainer:
    """The example in the trainer venv, its own process group; one log per life."""

    def __init__(self, tmp: Path, python: Path, args: list[str]) -> None:
        self.tmp = tmp
        self.argv = [str(python), str(EXAMPLE), *args]
        self.lives: list[Path] = []
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        log = self.tmp / f"trainer-{len(self.lives) + 1}.log"
        self.lives.append(log)
        return start_trainer(self.argv, log, env=trainer_env(), cwd=self.tmp)

    def kill_9_and_restart(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(30) == -signal.SIGKILL
        self.proc = self._start()

    def wait(self) -> None:
        try:
            rc = self.proc.wait(1200)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"trainer still running:\n{self.tail()}") from None
        assert rc == 0, self.tail()

    def tail(self) -> str:
        return self.lives[-1].read_text()[-4000:]


def test_a_specforge_eagle3_drafter_learns_from_the_stream_killed_once_and_resumed(
    tmp_path: Path,
) -> None:
    python = specforge_python()
    py = sys.executable
    subprocess.run([py, "-m", "tests.support.toytok", str(tmp_path / "tok")], check=True)
    subprocess.run([py, "-m", "tests.support.tinymodel", str(tmp_path / "model")], check=True)
    train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in chats(TRAIN)))
    heldout.write_text("".join(json.dumps(r) + "\n" for r in chats(HELDOUT, start=TRAIN)))
    model = ["--tokenizer", str(tmp_path / "tok"), "--model", str(tmp_path / "model"),
             "--layers", LAYERS]  # fmt: skip

    # The held-out set: a finished run, not streamed (its files stay), read in place.
    ho = Node(tmp_path, "heldout", str(heldout), "--out", str(tmp_path / "ho"), *model, "--json")
    assert ho.wait(300) == 0, ho.output()
    assert len(list((tmp_path / "ho" / "heldout").rglob("*.safetensors"))) == HELDOUT

    out = tmp_path / "out"
    node = Node(tmp_path, "run", str(train), "--out", str(out), *model,
                "--spool-budget", f"{BUDGET_K}K", "--json")  # fmt: skip
    watch = Watch(out / "train")
    url_file = out / ".hsq" / "redis-url"
    wait_until(url_file.exists, 120, interval=0.1)
    ckpt = tmp_path / "ckpt"
    trainer = Trainer(tmp_path, python, [
        "--run", "train", "--redis-url-file", str(url_file), "--target-model",
        str(tmp_path / "model"), "--ckpt", str(ckpt), "--every", str(EVERY), "--heldout",
        str(tmp_path / "ho" / "heldout"), "--lr", "1e-3", "--ttt-length", "3",
    ])  # fmt: skip

    # Killed once mid-stream: past its second checkpoint, with two steps since its last.
    def past_a_checkpoint() -> bool:
        evs = events(trainer.lives[0])
        saved = of(evs, "checkpoint")
        return len(saved) >= 2 and len(of(evs, "step")) >= saved[-1]["step"] + 2

    wait_until(past_a_checkpoint, 900, interval=0.05)
    trainer.kill_9_and_restart()
    trainer.wait()
    first, second = (events(p) for p in trainer.lives)

    # Every sample trained once into the final model, the lost steps replayed in order.
    final = torch.load(ckpt / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert final["finished"]
    ids = [str(r["id"]) for r in chats(TRAIN)]
    assert Counter(final["trained"]) == Counter(ids)
    assert final["step"] == TRAIN
    saved = of(first, "checkpoint")[-1]["step"]
    lost = [e["id"] for e in of(first, "step") if e["step"] > saved]
    assert lost, "the kill came right after a checkpoint: nothing to replay"
    (resumed,) = of(second, "resumed")
    assert resumed["step"] == saved
    again = [e["id"] for e in of(second, "step")]
    assert again[: len(lost)] == lost
    assert final["trained"] == [e["id"] for e in of(first, "step")][:saved] + again

    # SpecForge's own exporter reads the checkpoint; the served drafter names the run's layers.
    (written,) = of(second, "draft_config")
    assert written["layers"] == [1, 3, 6]
    drafter = tmp_path / "drafter"
    subprocess.run(
        [str(python.parent / "specforge"), "export", "--to", "sglang", "--checkpoint",
         str(ckpt / "checkpoint.pt"), "--draft-config", str(ckpt / "draft_config.json"),
         "--output-dir", str(drafter)],
        check=True, capture_output=True, env=trainer_env(),
    )  # fmt: skip
    served = json.loads((drafter / "config.json").read_text())
    assert served["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang's

    # The drafter learned: SpecForge's held-out metrics, before the first step and at the end.
    evals = [*of(first, "eval"), *of(second, "eval")]
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and after.get("final") and after["step"] == TRAIN
    done = of(second, "done")[0]
    print(
        f"held-out: step 0 ploss_0 {before['eval/ploss_0']:.3f} acc {before['eval/avg_acc']:.3f}"
        f" -> step {TRAIN} ploss_0 {after['eval/ploss_0']:.3f} acc {after['eval/avg_acc']:.3f}"
        f" (simulated acceptance length {before['eval/simulated_acc_len']:.3f} -> "
        f"{after['eval/simulated_acc_len']:.3f}); killed at step {saved + len(lost)}, resumed "
        f"at {saved}, {len(lost)} replayed; second life {done['wall_s']} s, data wait "
        f"{done['wait_share']:.1%}"
    )
    assert after["eval/ploss_0"] < before["eval/ploss_0"]
    assert after["eval/avg_acc"] > before["eval/avg_acc"]

    # `hsq run` ends once all is committed; the spool stayed within its budget plus a file.
    assert node.wait(600) == 0, node.output()
    watch.stop()
    summary = node.summary()
    assert str(summary["stream"]).startswith("stream   every sample committed by every group")
    status = summary["status"]
    assert isinstance(status, dict) and status["done"] == TRAIN and status["dead"] == 0
    assert not list((out / "train").rglob("*.safetensors"))
    assert sum(watch.sizes.values()) >= 10 * BUDGET_K * 1024  # the budget did bound the disk
    assert 0 < watch.peak_disk <= BUDGET_K * 1024 + watch.largest, (
        watch.peak_disk,
        watch.largest,
    )
    print(
        f"spool peak {watch.peak_disk} B (budget {BUDGET_K * 1024} B, largest file "
        f"{watch.largest} B), outputs {sum(watch.sizes.values())} B in all"
    )


def test_a_budget_below_the_checkpoint_interval_is_said_and_a_smaller_interval_gets_out(
    tmp_path: Path,
) -> None:
    """The trainer commits nothing before its next checkpoint, and nothing is extracted while
    the spool is full: a budget below `--every` samples stops both sides for good. The
    example says that it waits and what may be why (`waiting`, with its uncommitted count),
    `hsq run` shows the spool full; killed and started again with a smaller `--every`, the
    uncommitted samples come again, every sample is trained once and the run ends."""
    python = specforge_python()
    py = sys.executable
    subprocess.run([py, "-m", "tests.support.toytok", str(tmp_path / "tok")], check=True)
    subprocess.run([py, "-m", "tests.support.tinymodel", str(tmp_path / "model")], check=True)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in chats(24)))
    out = tmp_path / "out"
    node = Node(tmp_path, "run", str(train), "--out", str(out), "--tokenizer",
                str(tmp_path / "tok"), "--model", str(tmp_path / "model"), "--layers", LAYERS,
                "--spool-budget", "256K", "--json")  # fmt: skip
    url_file = out / ".hsq" / "redis-url"
    wait_until(url_file.exists, 120, interval=0.1)
    ckpt = tmp_path / "ckpt"
    trainer = Trainer(tmp_path, python, [
        "--run", "train", "--redis-url-file", str(url_file), "--target-model",
        str(tmp_path / "model"), "--ckpt", str(ckpt), "--every", "8", "--lr", "1e-3",
        "--ttt-length", "3", "--say-waiting-s", "1",
    ])  # fmt: skip

    def stuck() -> bool:
        waits = of(events(trainer.lives[0]), "waiting")
        return bool(waits) and waits[-1]["uncommitted"] > 0 and waits[-1]["for_s"] >= 3

    wait_until(stuck, 300, interval=0.1)
    wait_until(lambda: "spool full (waiting for the consumers to commit)" in node.output(), 60)
    first = events(trainer.lives[0])
    assert not of(first, "checkpoint") and not ckpt.joinpath("checkpoint.pt").exists()
    (said,) = of(first, "waiting")[-1:]
    assert "smaller --every" in said["why"] and said["uncommitted"] == len(of(first, "step"))

    trainer.argv[trainer.argv.index("--every") + 1] = "2"
    trainer.kill_9_and_restart()
    trainer.wait()
    second = events(trainer.lives[1])
    assert not of(second, "resumed")  # no checkpoint was written: it starts afresh
    assert [e["id"] for e in of(second, "step")][: len(of(first, "step"))] == [
        e["id"] for e in of(first, "step")
    ]  # the uncommitted samples, again and in order
    final = torch.load(ckpt / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert Counter(final["trained"]) == Counter(str(r["id"]) for r in chats(24))
    assert node.wait(300) == 0, node.output()
    assert not list((out / "train").rglob("*.safetensors"))
