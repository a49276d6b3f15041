"""Train an EAGLE-3 drafter while hsq extracts: SpecForge's model and loss over hsq's stream.

    # the trainer's venv: SpecForge with its own pins, plus hsq's base install (the stream
    # reader; its dependencies pin neither torch nor transformers): `make dist`'s wheel
    pip install specforge==0.2.0 dist/hidden_state_queue-*.whl
    hsq run chats.jsonl --tokenizer /models/m --model /models/m --out /shared/hs \\
        --spool-budget 200G &
    python examples/train_eagle3_from_stream.py --run chats \\
        --redis-url-file /shared/hs/.hsq/redis-url --target-model /models/m \\
        --ckpt /shared/drafter-ckpt --every 100 [--heldout /shared/hs-heldout/heldout]

What is SpecForge 0.2.0's, unchanged: the draft model (`AutoDraftModel` from the draft config
SpecForge derives from the target, the target's embedding loaded and frozen), the EAGLE-3
training model with test-time training (`OnlineEagle3Model`), the step (`Eagle3TrainStrategy`:
the frozen LM head turns the stored final state into the teacher's distribution, the loss
is its KL loss over `ttt_length` positions), the optimizer (`BF16Optimizer`: AdamW over fp32
master weights, gradient clipping), the per-sample normalization of offline states
(`normalize_offline_sample`) and the held-out metrics (`Evaluator`: `eval/avg_acc`,
`eval/ploss_0`, `eval/simulated_acc_len`, as `specforge train` logs them).

What is this script's: the loop. One stream item is one optimizer step (SpecForge's
`batch_size: 1`). Every `--every` steps a checkpoint (model, optimizer with its fp32
masters, step, the ids trained, and the dataset's `state_dict()`) is written to a
temporary file, fsynced and renamed over `CKPT/checkpoint.pt`, and only then is
`ds.commit(state)` called: hsq removes the committed samples' files and frees their spool
space. Killed anywhere (kill -9 included) and started again with the same command, it
loads that checkpoint (`ds.load_state_dict`) and hsq delivers again exactly the samples
the checkpoint had not seen, in the same order: every sample is trained once into the
final model.

Size the spool budget for at least `--every` samples (plus the DataLoader's prefetch):
nothing is committed before the next checkpoint and nothing is extracted while the spool
is full, so a smaller budget stops both sides for good.

Why not speculators' trainer or `specforge train`: neither takes a DataLoader over the
stream without patching (measured: docs/training.md, "A real trainer on the stream").

On a machine without CUDA the Triton kernel of SpecForge's loss cannot run: the script
then puts SpecForge's own reference implementation of the same loss in its place
(`specforge.core.loss._compute_loss`), as `tests.support.specforge_cpu` does for
`specforge train`. Nothing else changes. One process: SpecForge's optimizer logs through
torch.distributed, so the script makes a process group of this one process (DDP is left
to the user: a `rank` per process, docs/training.md).

One JSON object per line on stdout: `start`, `resumed`, `step`, `checkpoint`, `eval`,
`waiting` (no item for `--say-waiting-s` seconds, with what may be the cause),
`draft_config`, `done`.

Serving the drafter: `CKPT/checkpoint.pt` has SpecForge's checkpoint keys and, at the end,
`CKPT/draft_config.json` names the run's layers, so SpecForge's own exporter writes the
SGLang drafter: `specforge export --to sglang --checkpoint CKPT/checkpoint.pt
--draft-config CKPT/draft_config.json --output-dir DRAFTER`.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hsq.data import HiddenStateDataset, StreamingDataLoader, StreamingHiddenStateDataset

CHECKPOINT = "checkpoint.pt"
DRAFT_CONFIG = "draft_config.json"
TARGET_HELP = "the local HF checkpoint the run extracts from (config, embedding, LM head)"


_SAY = threading.Lock()


def say(event: str, **fields: Any) -> None:
    with _SAY:  # the `waiting` thread too: whole lines
        print(json.dumps({"event": event, **fields}), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the streamed run (hsq run --spool-budget)")
    url = p.add_mutually_exclusive_group(required=True)
    url.add_argument("--redis-url-file", type=Path, help="OUT/.hsq/redis-url of `hsq run`")
    url.add_argument("--redis-url", help="the run's Redis (rediss://... for another host)")
    p.add_argument("--group", default="train", help="the consumer group (--consumers)")
    p.add_argument("--target-model", type=Path, required=True, help=TARGET_HELP)
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint directory (resumed)")
    p.add_argument("--every", type=int, default=100, help="checkpoint and commit every N steps")
    p.add_argument("--heldout", type=Path, help="a finished run's output directory: evaluated")
    p.add_argument("--eval-every", type=int, default=0, help="0: at the start and the end")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--draft-vocab-size", type=int, help="default: min(32000, the target's)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--attention-backend", default="sdpa", help="sdpa, flex_attention, fa")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--say-waiting-s", type=float, default=60.0, help="0: never say")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- SpecForge parts
def use_reference_loss() -> None:
    """No CUDA: SpecForge's Triton loss kernel cannot run; its reference loss can."""
    import specforge.algorithms.eagle3.model as eagle3_model
    import specforge.core.loss as loss

    reference = getattr(loss._compute_loss, "__wrapped__", loss._compute_loss)

    class ReferenceLoss:
        @staticmethod
        def apply(logits: Any, target_p: Any, position_mask: Any) -> Any:
            return reference(logits, target_p, position_mask)

    loss.LogSoftmaxLoss = ReferenceLoss
    eagle3_model.LogSoftmaxLoss = ReferenceLoss


def one_process_group() -> None:
    """SpecForge's helpers (the optimizer's load_state_dict logs through print_on_rank0) ask
    torch.distributed for the rank, as `specforge train` always has a process group: a
    group of this one process, in memory (no port, no file)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("error: this example trains in one process (see its docstring)")
    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]  # exported, not in the stubs
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def write_atomically(path: Path, write: Any) -> None:
    """`write(file)` to a temporary file, fsynced, renamed over `path`, directory fsynced:
    a kill leaves the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def draft_config_file(args: argparse.Namespace, layers: list[int] | None = None) -> Path:
    """The EAGLE-3 draft config SpecForge derives from the target (the same function writes
    `hsq export --target-model`'s draft_config.json), kept in the checkpoint directory so a
    restart builds the same model. With the run's `layers` (pinned by its first dump, so
    known only once samples came) it is written again with `eagle_config`'s layer ids in
    SGLang's numbering: the served drafter then captures the layers it was trained on."""
    from hsq.ops.export.target import draft_config, load_config

    path: Path = args.ckpt / DRAFT_CONFIG
    if not path.exists() or layers:
        obj, _ = draft_config(load_config(args.target_model), layers or [], args.draft_vocab_size)
        data = (json.dumps(obj, indent=2) + "\n").encode()
        write_atomically(path, lambda f: f.write(data))
    return path


def lm_head(target: Path) -> torch.Tensor:
    """The target's LM head (its embedding where tied), from its safetensors files."""
    from safetensors import safe_open

    config = json.loads((target / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    want = ["lm_head.weight", *(["model.embed_tokens.weight"] if tied else [])]
    for name in want:
        for f in sorted(target.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                if name in st.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    head: torch.Tensor = st.get_tensor(name)
                    return head
    raise SystemExit(f"error: {target} has no {' or '.join(want)} in *.safetensors")


class Parts:
    """SpecForge's EAGLE-3 model, frozen target head, step and optimizer."""

    def __init__(self, args: argparse.Namespace) -> None:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.auto import AutoDraftModel
        from specforge.modeling.target.target_head import TargetHead
        from specforge.optimizer import BF16Optimizer
        from specforge.training.model_loading import load_draft_config_source
        from specforge.training.strategies.base import Eagle3TrainStrategy

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        config = load_draft_config_source(str(draft_config_file(args)))
        draft = AutoDraftModel.from_config(
            config, attention_backend=args.attention_backend, torch_dtype=torch.bfloat16
        )
        draft.load_embedding(str(args.target_model))
        draft.freeze_embedding()
        self.model = OnlineEagle3Model(
            draft_model=draft, length=args.ttt_length, attention_backend=args.attention_backend
        ).to(device=device, dtype=torch.bfloat16)
        head = TargetHead(str(args.target_model))  # the config only; the weight below
        with torch.no_grad():
            head.fc.weight.copy_(lm_head(args.target_model))
        head.freeze_weights()
        self.head = head.eval().to(device=device, dtype=torch.bfloat16)
        self.strategy = Eagle3TrainStrategy(self.model, target_head=self.head)
        self.optimizer = BF16Optimizer(
            self.model, lr=args.lr, total_steps=1, warmup_ratio=0.0, lr_scheduler="constant"
        )

    def train_step(self, batch: Any) -> dict[str, float]:
        self.model.train()
        out = self.strategy.forward_loss(batch)
        out.loss.backward()
        self.optimizer.step()
        acc = out.metrics["acces"][0]
        return {"loss": round(float(out.loss.detach()), 4), "acc_0": round(float(acc), 4)}

    def evaluate(self, batches: list[Any]) -> dict[str, float]:
        from specforge.eval.evaluator import Evaluator

        self.model.eval()
        metrics = Evaluator().run(self.strategy.forward_loss, batches)
        keep = ("eval/avg_loss", "eval/avg_acc", "eval/ploss_0", "eval/simulated_acc_len")
        return {k: round(float(metrics[k]), 4) for k in keep if k in metrics}


def to_batch(item: dict[str, Any], max_length: int) -> Any:
    """An hsq item (one sample) as SpecForge's offline batch: its own normalization of the
    states SpecForge stores (`aux_hidden_state` [1,T,3H], `hidden_state` [1,T,H]: hsq's
    `last_hidden_state`, after the final norm), in bf16 as SpecForge reads them."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.contracts import TrainBatch

    raw = {
        "input_ids": item["input_ids"].long(),
        "loss_mask": item["loss_mask"].long(),
        "aux_hidden_state": item["aux_hidden_states"].to(torch.bfloat16).unsqueeze(0),
        "hidden_state": item["last_hidden_state"].to(torch.bfloat16).unsqueeze(0),
    }
    tensors = normalize_offline_sample(raw, max_length)
    return TrainBatch(sample_ids=[str(item["id"])], strategy="eagle3", tensors=tensors,
                      metadata={"target_repr": "hidden_state"})  # fmt: skip


# ---------------------------------------------------------------------------- the loop
WAIT_HINT = (
    "extraction is slower than training; or, if `hsq status` says the spool is full, the "
    "spool budget holds fewer samples than --every: nothing is committed before the next "
    "checkpoint, so raise the budget (hsq enqueue --spool-budget) or restart with a "
    "smaller --every (the uncommitted samples are delivered again)"
)


class Waiting:
    """Says why the loop waits: while it waits for the stream's next item, a `waiting` line
    every `every_s` seconds (a thread; the loop itself is blocked in the loader)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.since: float | None = time.monotonic()
        self.uncommitted = 0
        if every_s > 0:
            threading.Thread(target=self._loop, daemon=True).start()

    def asking(self, uncommitted: int) -> None:
        self.uncommitted, self.since = uncommitted, time.monotonic()

    def got(self) -> None:
        self.since = None

    def _loop(self) -> None:
        while True:
            time.sleep(self.every_s)
            since = self.since
            if since is not None and time.monotonic() - since >= self.every_s:
                waited = round(time.monotonic() - since)
                say("waiting", for_s=waited, uncommitted=self.uncommitted, why=WAIT_HINT)


def save(args: argparse.Namespace, parts: Parts, step: int, trained: list[str],
         data: dict[str, Any], finished: bool) -> None:  # fmt: skip
    """SpecForge's checkpoint keys (`strategy`, `draft_state_dict`: the draft weights but the
    frozen embedding, which comes from the target), so `specforge export --to sglang
    --checkpoint CKPT/checkpoint.pt` reads it, plus the loop's own."""
    state = {
        "strategy": "eagle3",
        "draft_state_dict": parts.strategy.checkpoint_state_filter(parts.model.state_dict()),
        "optimizer": parts.optimizer.state_dict(),
        "step": step,
        "trained": trained,
        "data": data,
        "finished": finished,
    }
    write_atomically(args.ckpt / CHECKPOINT, lambda f: torch.save(state, f))


def restore(parts: Parts, ckpt: dict[str, Any]) -> None:
    draft = parts.model.draft_model
    missing, unexpected = draft.load_state_dict(ckpt["draft_state_dict"], strict=False)
    if unexpected or any("embed" not in k for k in missing):
        raise SystemExit(f"error: the checkpoint does not fit the model: {missing, unexpected}")
    parts.optimizer.load_state_dict(ckpt["optimizer"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if not torch.cuda.is_available():
        use_reference_loss()
    one_process_group()
    args.ckpt.mkdir(parents=True, exist_ok=True)
    for left in args.ckpt.glob(f".{CHECKPOINT}.*.tmp"):
        left.unlink()  # a killed life's half-written checkpoint (one trainer per directory)
    where = {"redis_url_file": args.redis_url_file} if args.redis_url_file else {}
    ds = StreamingHiddenStateDataset(args.run, redis_url=args.redis_url, **where,
                                     group=args.group, max_length=args.max_length)  # fmt: skip
    parts = Parts(args)
    step, trained = 0, []
    path = args.ckpt / CHECKPOINT
    if path.exists():
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        restore(parts, ckpt)
        ds.load_state_dict(ckpt["data"])  # commits what it covers; the rest comes again
        step, trained = int(ckpt["step"]), list(ckpt["trained"])
        say("resumed", step=step, trained=len(trained), finished=bool(ckpt["finished"]))
    else:
        say("start", run=args.run, group=args.group)
    heldout = []
    if args.heldout is not None:
        held = HiddenStateDataset(args.heldout)
        heldout = [to_batch(held[i], args.max_length) for i in range(len(held))]
        if step == 0:
            say("eval", step=0, **parts.evaluate(heldout))
    started = time.monotonic()
    since = 0
    waiting = Waiting(args.say_waiting_s)
    for item in StreamingDataLoader(ds, batch_size=None, num_workers=args.workers):
        waiting.got()
        metrics = parts.train_step(to_batch(item, args.max_length))
        step, since = step + 1, since + 1
        trained.append(str(item["id"]))
        say("step", step=step, id=str(item["id"]), **metrics)
        if since >= args.every:
            state = ds.state_dict()
            save(args, parts, step, trained, state, finished=False)
            ds.commit(state)  # only once the checkpoint holding `state` is durable
            since = 0
            say("checkpoint", step=step, trained=len(trained), **ds.wait_stats())
        if heldout and args.eval_every and step % args.eval_every == 0:
            say("eval", step=step, **parts.evaluate(heldout))
        waiting.asking(uncommitted=since)
    waiting.got()
    state = ds.state_dict()
    save(args, parts, step, trained, state, finished=True)
    ds.commit(state)
    layers = ds.store.require_config().layer_ids
    say("draft_config", path=str(draft_config_file(args, layers)), layers=layers)
    if heldout:
        say("eval", step=step, final=True, **parts.evaluate(heldout))
    say("done", step=step, trained=len(trained), wall_s=round(time.monotonic() - started, 1),
        **ds.wait_stats())  # fmt: skip


if __name__ == "__main__":
    main()
