"""Server-side dump cost: prefill with dumps against the forward alone, per workload.

For each workload (LO-HI:COUNT: COUNT requests of random lengths in [LO, HI]) the requests
are cut into batches once, as the reference engine's FIFO forms them from a full queue
(--batch-requests, --batch-tokens padded), and every mode runs exactly those batches, so
the modes differ only in what happens around the forward:

    forward      the model's forward alone (HiddenStateModel.forward_batch), back to back
    engine       the reference engine (requests, batching, per-request results), no dumps
    copy         + the device-to-host copy into the pinned ring, no files written
    dump         + the dump files, written by the writer thread (tmpfs, no fsync): the server
    dump-spin    `dump` with the writer spinning on the copy event (the old behaviour)
    fp8          `dump` with --dump-encoding fp8-e4m3 (quantized on the device)
    prenorm      `dump` with --prenorm (one more [T, H] tensor)
    hook         the forward plus the SGLang hook's DumpHook.capture and writer thread
                 (hsq/engines/sglang), without SGLang: the hook's own cost
    hook-staged  `hook` with SGLANG_HS_DEVICE_STAGING=1 (rows cloned on the GPU, so the
                 next forward does not wait for the copy to the host)

The engine is driven with exactly one batch in its queue at a time (pause, queue the
batch's requests, resume), so the batches match the forward-only replay; each mode runs
--repeats times, interleaved, best time kept. Reported: tokens/s per mode, its ratio to
`forward` (target for `dump`: >= 0.95), how long the writer held the engine up
(backpressure), the writer's copy-wait and write time, and the CUDA allocator's device
allocations during the mode. One JSON line at the end.

    python -m bench.dump_cost --preset h200     # one H200, llama-8b shape, about 3 minutes
    python -m bench.dump_cost --preset cpu      # the tiny model on a CPU, about a minute
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsq.dump.find import clear_dump_dir
from hsq.engines.common import DumpContext
from hsq.engines.reference.app import dump_bytes_per_token
from hsq.engines.reference.dumper import DumpWriter, HostBatch, WriterStats, _Job
from hsq.engines.reference.engine import Engine
from hsq.engines.reference.faults import FaultPlan
from hsq.engines.reference.model import HiddenStateModel, bucket_length, load_model
from hsq.engines.sglang.config import HookConfig
from hsq.engines.sglang.dump_hook import DumpHook
from hsq.engines.sglang.plan import BatchPlan, RidFilter, build_plan
from hsq.logs import configure
from hsq.states import FP8, PLAIN

MODES = (
    "forward",
    "engine",
    "copy",
    "dump",
    "dump-spin",
    "fp8",
    "prenorm",
    "hook",
    "hook-staged",
)
PRESETS: dict[str, dict[str, Any]] = {
    "h200": {
        "model": "llama-8b",
        "device": "cuda",
        "workloads": "64-512:96,1024-4096:24",
        "batch_requests": 16,
        "batch_tokens": 16384,
    },
    "cpu": {
        "model": "tiny",
        "device": "cpu",
        "workloads": "16-128:64,256-1024:12",
        "batch_requests": 8,
        "batch_tokens": 4096,
    },
    "smoke": {
        "model": "tiny",
        "device": "cpu",
        "workloads": "8-32:8",
        "batch_requests": 4,
        "batch_tokens": 256,
        "repeats": 1,
    },
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NullWriter(DumpWriter):
    """`engine` mode: the engine's path with nothing copied or written."""

    def to_host(self, tensors: dict[str, torch.Tensor]) -> HostBatch:
        return HostBatch(tensors)

    def submit(self, parts: list[Any], batch: HostBatch) -> None:
        pass


class CopyOnlyWriter(DumpWriter):
    """`copy` mode: the device-to-host copies land, the files are never written."""

    def _write(self, job: _Job) -> None:
        t0 = time.perf_counter()
        job.batch.wait()
        self.stats.copy_wait_s += time.perf_counter() - t0
        self.release(job.batch)


@dataclass
class Workload:
    spec: str
    seqs: list[list[int]]
    groups: list[list[int]]
    """Request indices per batch: what every mode runs."""

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    @property
    def max_batch_tokens(self) -> int:
        return max(sum(len(self.seqs[i]) for i in g) for g in self.groups)


def fifo_batches(seqs: list[list[int]], max_requests: int, max_tokens: int) -> list[list[int]]:
    """Request indices per batch, as Engine._take forms them from a full queue."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, s in enumerate(seqs):
        n = len(s)
        if cur and (len(cur) >= max_requests or (len(cur) + 1) * max(longest, n) > max_tokens):
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def make_workload(spec: str, vocab: int, args: argparse.Namespace) -> Workload:
    span, _, count = spec.partition(":")
    lo, _, hi = span.partition("-")
    rng = random.Random(spec)
    seqs = [
        [rng.randrange(vocab) for _ in range(rng.randint(int(lo), int(hi)))]
        for _ in range(int(count))
    ]
    return Workload(spec, seqs, fifo_batches(seqs, args.batch_requests, args.batch_tokens))


def run_engine(engine: Engine, w: Workload, pool: ThreadPoolExecutor) -> None:
    """Each batch queued whole while the engine is paused, then released: the engine runs
    exactly `w.groups`. The next batch is queued as soon as this one is launched (its
    requests answered), while the device still computes it, as a busy server's queue is."""
    for group in w.groups:
        engine.pause()
        futures = [pool.submit(engine.generate, w.seqs[i]) for i in group]
        while engine.pending < len(group):
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                engine.resume()
                raise RuntimeError("a request failed before its batch formed") from (
                    failed[0].exception()
                )
            time.sleep(0.0001)
        engine.resume()
        for f in futures:
            f.result()
    engine.writer.flush()


def run_forward(model: HiddenStateModel, w: Workload) -> None:
    for group in w.groups:
        model.forward_batch([w.seqs[i] for i in group])


@dataclass
class HookRig:
    hook: DumpHook
    plans: list[BatchPlan]
    ids: list[torch.Tensor]


def hook_rig(
    model: HiddenStateModel, w: Workload, dump_dir: Path, *, staged: bool = False
) -> HookRig:
    @dataclass
    class Req:
        rid: str
        origin_input_ids: list[int]

    cfg = HookConfig(
        dump_dir=dump_dir,
        fsync=False,
        queue_items=8,
        queue_bytes=8 << 30,
        device_staging=staged,
    )
    hook = DumpHook(cfg, DumpContext(model.identity, model.layer_ids), attn_tp_rank=0)
    plans, ids = [], []
    for group in w.groups:
        reqs = [Req(f"hsq-{i}", w.seqs[i]) for i in group]
        lens = [len(w.seqs[i]) for i in group]
        plan = build_plan(reqs, [0] * len(group), lens, RidFilter())
        assert plan is not None
        plans.append(plan)
        flat = [t for i in group for t in w.seqs[i]]
        ids.append(torch.tensor(flat, dtype=torch.long, device=model.device))
    return HookRig(hook, plans, ids)


def run_hook(model: HiddenStateModel, w: Workload, rig: HookRig) -> None:
    """What the SGLang hook adds to a forward: capture() on the forward's outputs (packed
    per request, as the logits processor sees them) and the writer thread."""
    for group, plan, ids in zip(w.groups, rig.plans, rig.ids, strict=True):
        cap = model.forward_batch([w.seqs[i] for i in group])
        if not rig.hook.capture(plan, ids, cap.last, cap.aux):
            raise RuntimeError("the hook refused a batch; see the log")
    rig.hook.flush(600)


def device_allocs(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_device_alloc", 0))


class Rig:
    """Every mode's engine, writer (and the hook) for one workload, built once: their
    pinned rings are allocated once, and round 0 warms them all up."""

    def __init__(
        self, w: Workload, model: HiddenStateModel, dump_dir: Path, args: argparse.Namespace
    ) -> None:
        self.w, self.model = w, model
        self.modes = [m for m in args.modes.split(",") if m]
        self.writers: dict[str, DumpWriter] = {}
        self.engines: dict[str, Engine] = {}
        for mode in self.modes:
            if mode == "forward" or mode.startswith("hook"):
                continue
            enc = FP8 if mode == "fp8" else PLAIN
            per = dump_bytes_per_token(model, enc, prenorm=mode == "prenorm")
            cls = {"engine": NullWriter, "copy": CopyOnlyWriter}.get(mode, DumpWriter)
            self.writers[mode] = cls(
                dump_dir,
                depth=2,
                fsync=False,
                device=model.device,
                max_bytes=0 if mode == "engine" else w.max_batch_tokens * per + 1024,
                threads=args.writer_threads,
                blocking_event=mode != "dump-spin",
            )
            self.engines[mode] = Engine(
                model,
                self.writers[mode],
                FaultPlan(),
                max_tokens=max(len(x) for x in w.seqs),
                max_batch_requests=args.batch_requests,
                max_batch_tokens=args.batch_tokens,
                encoding=enc,
            )
        self.hooks = {
            m: hook_rig(model, w, dump_dir, staged=m == "hook-staged")
            for m in self.modes
            if m.startswith("hook")
        }
        self.pool = ThreadPoolExecutor(args.batch_requests, thread_name_prefix="client")

    def run(self, mode: str) -> None:
        self.model.prenorm = mode == "prenorm"
        try:
            if mode == "forward":
                run_forward(self.model, self.w)
            elif mode in self.hooks:
                run_hook(self.model, self.w, self.hooks[mode])
            else:
                run_engine(self.engines[mode], self.w, self.pool)
            sync(self.model.device)
        finally:
            self.model.prenorm = False

    def close(self) -> None:
        self.pool.shutdown()
        for wr in self.writers.values():
            wr.close()
        for rig in self.hooks.values():
            rig.hook.close()


def measure(
    w: Workload, model: HiddenStateModel, dump_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    dev = model.device
    rig = Rig(w, model, dump_dir, args)
    times: dict[str, list[float]] = {m: [] for m in rig.modes}
    stats: dict[str, WriterStats] = {}
    allocs: dict[str, int] = {}
    try:
        for rep in range(args.repeats + 1):  # round 0 warms up: shapes, allocator, rings
            for mode in rig.modes:
                if mode in rig.writers:
                    rig.writers[mode].stats = WriterStats()
                a0 = device_allocs(dev)
                sync(dev)
                t0 = time.perf_counter()
                rig.run(mode)
                dt = time.perf_counter() - t0
                clear_dump_dir(dump_dir)
                if rep == 0:
                    continue
                times[mode].append(dt)
                allocs[mode] = allocs.get(mode, 0) + device_allocs(dev) - a0
                if mode in rig.writers and dt <= min(times[mode]):
                    stats[mode] = rig.writers[mode].stats  # the best round's
    finally:
        rig.close()
    return {
        "workload": w.spec,
        "requests": len(w.seqs),
        "tokens": w.tokens,
        "batches": len(w.groups),
        "mean_batch": round(statistics.mean(len(g) for g in w.groups), 2),
        "padded_share": round(
            1 - w.tokens / sum(len(g) * pad_len(w, g, model) for g in w.groups), 3
        ),
        "modes": summarize(w, times, stats, allocs),
    }


def summarize(
    w: Workload,
    times: dict[str, list[float]],
    stats: dict[str, WriterStats],
    allocs: dict[str, int],
) -> dict[str, dict[str, Any]]:
    best = {m: min(ts) for m, ts in times.items()}
    base = best.get("forward")
    rows = {}
    for mode, t in best.items():
        row: dict[str, Any] = {
            "tok_s": round(w.tokens / t, 1),
            "seconds": round(t, 4),
            "spread": round(max(times[mode]) / t - 1, 4),
            "device_allocs": allocs.get(mode, 0),
        }
        if base is not None:
            row["vs_forward"] = round(base / t, 4)
        if mode in stats:
            s = stats[mode]
            row.update(
                held_ms=round(s.held_s * 1e3, 1),
                copy_wait_ms=round(s.copy_wait_s * 1e3, 1),
                write_ms=round(s.write_s * 1e3, 1),
                dump_bytes=s.bytes,
            )
        rows[mode] = row
    return rows


def pad_len(w: Workload, group: list[int], model: HiddenStateModel) -> int:
    longest = max(len(w.seqs[i]) for i in group)
    return bucket_length(longest) if model.device.type == "cuda" else longest


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--model")
    ap.add_argument("--device")
    ap.add_argument("--workloads", help="LO-HI:COUNT,... (random lengths in [LO, HI])")
    ap.add_argument("--batch-requests", type=int)
    ap.add_argument("--batch-tokens", type=int, help="padded tokens per forward")
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    ap.add_argument("--repeats", type=int, help="timed rounds after one warm-up round")
    ap.add_argument("--writer-threads", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--dump-root", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    for key in ("model", "device", "workloads", "batch_requests", "batch_tokens", "repeats"):
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, 2))
    if args.threads:
        torch.set_num_threads(args.threads)
    configure("WARNING", "console")  # the writers' per-dump debug lines would drown the table
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    # The pre-norm tap is always installed (a reference kept per forward); modes other
    # than `prenorm` do not dump it.
    model = load_model(
        args.model, device=args.device, dtype=dtype, dump_dtype=torch.bfloat16, layers=None,
        prenorm=True,
    )  # fmt: skip
    model.prenorm = False
    load_s = time.perf_counter() - t0
    dump_dir = Path(tempfile.mkdtemp(prefix="hsq-dumpcost-", dir=args.dump_root))
    results = []
    try:
        for spec in filter(None, args.workloads.split(",")):
            w = make_workload(spec, model.vocab_size, args)
            results.append(measure(w, model, dump_dir, args))
            report(results[-1], sys.stdout.write)
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    out = {
        "dump_cost": results,
        "model": args.model,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "batch_requests": args.batch_requests,
        "batch_tokens": args.batch_tokens,
        "writer_threads": args.writer_threads,
        "repeats": args.repeats,
        "model_load_s": round(load_s, 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "args": {k: v for k, v in vars(args).items() if k != "preset"} | {"preset": args.preset},
    }
    print(json.dumps(out))
    return out


def report(r: dict[str, Any], write: Callable[[str], object]) -> None:
    write(
        f"\n{r['workload']}: {r['requests']} requests, {r['tokens']} tokens, {r['batches']} "
        f"batches (mean {r['mean_batch']} requests, {r['padded_share']:.0%} padding)\n"
    )
    write(
        f"  {'mode':<10} {'tok/s':>10} {'vs forward':>10} {'spread':>7} {'held ms':>8} "
        f"{'copy wait':>9} {'write ms':>9} {'dev allocs':>10}\n"
    )
    for mode, m in r["modes"].items():
        write(
            f"  {mode:<10} {m['tok_s']:>10,.0f} {m.get('vs_forward', float('nan')):>10.3f} "
            f"{m['spread']:>7.1%} {m.get('held_ms', ''):>8} {m.get('copy_wait_ms', ''):>9} "
            f"{m.get('write_ms', ''):>9} {m['device_allocs']:>10}\n"
        )


if __name__ == "__main__":
    main()
