"""Server-side dump cost: the reference engine's prefill with dumping vs the bare forward.

In one process, for each length: K forwards of the model alone, then K requests through
the engine (forward, cast, pinned async device-to-host copy, hand-off to the writer thread,
which writes the dump while the next forward runs), with the writer drained at the end.
The ratio is what dumping adds to prefill time.

With --workloads (e.g. 64-512:64,1024-4096:24: random lengths in a range, that many
requests), the batched figure: the model's forward-only rate over the batches the engine
forms (FIFO, --batch-requests, --batch-tokens padded), against the engine's rate with
--clients threads keeping requests in flight (batched forward, one host copy per batch, one
dump per request written while the next batch runs). Target: capacity with dumps >= 0.90
of the forward-only batched rate.

    python -m bench.dump_cost --model llama-8b --device cuda --lengths 2048,8192
    python -m bench.dump_cost --model llama-8b --device cuda --lengths "" \
        --workloads 64-512:64,1024-4096:24
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hsq.protocol import clear_dump_dir
from hsq.sglang_server.reference.dumper import DumpWriter
from hsq.sglang_server.reference.engine import Engine
from hsq.sglang_server.reference.faults import FaultPlan
from hsq.sglang_server.reference.model import load_model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def varlen_probe(model: object, device: str, n: int = 20) -> None:
    """Median forward time over n new lengths in 64..512 against one fixed length."""
    import random
    import statistics

    rng = random.Random(0)
    fwd = model.forward  # type: ignore[attr-defined]
    vocab = model.vocab_size  # type: ignore[attr-defined]
    for label, lens in (
        ("varying", [rng.randint(64, 512) for _ in range(n)]),
        ("fixed", [288] * n),
    ):
        times = []
        for length in lens:
            ids = [rng.randrange(vocab) for _ in range(length)]
            sync(device)
            t0 = time.perf_counter()
            fwd(ids)
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        print(
            f"forward, {label} lengths: median {statistics.median(times):.1f} ms, "
            f"max {max(times):.1f} ms"
        )


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


def drive(engine: Engine, seqs: list[list[int]], clients: int) -> None:
    """`clients` threads keep requests in flight until every sequence was served."""
    todo = list(reversed(seqs))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                ids = todo.pop()
            engine.generate(ids)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.writer.flush()


def batched(
    model: Any, device: str, dump_dir: Path, spec: str, args: argparse.Namespace, per_token: int
) -> dict[str, Any]:
    span, _, count = spec.partition(":")
    lo, _, hi = span.partition("-")
    rng = random.Random(spec)
    seqs = [
        [rng.randrange(model.vocab_size) for _ in range(rng.randint(int(lo), int(hi)))]
        for _ in range(int(count))
    ]
    tokens = sum(len(s) for s in seqs)
    groups = fifo_batches(seqs, args.batch_requests, args.batch_tokens)  # warm-up only
    writer = DumpWriter(
        dump_dir,
        depth=2,
        fsync=False,
        device=model.device,
        max_bytes=max(args.batch_tokens, int(hi)) * per_token + 256,
    )
    engine = Engine(
        model,
        writer,
        FaultPlan(),
        max_tokens=int(hi),
        max_batch_requests=args.batch_requests,
        max_batch_tokens=args.batch_tokens,
    )

    def run_engine() -> None:
        drive(engine, seqs, args.clients)

    formed: list[list[list[int]]] = []
    real_forward = model.forward_batch

    def recording(batch: list[list[int]]) -> Any:
        formed.append(batch)
        return real_forward(batch)

    def run_forward() -> None:
        # The batches the engine formed in its last run: the same work, without dumps.
        for batch in replay:
            real_forward(batch)

    replay = [[seqs[i] for i in g] for g in groups]
    if args.warmup_shapes:
        engine.warmup_shapes()
    run_forward()  # warm-up: allocator, pinned buffers
    run_engine()
    sync(device)
    clear_dump_dir(dump_dir)
    times: dict[str, float] = {}
    batches0 = engine.batches
    model.forward_batch = recording
    for mode in ("engine", "forward", "engine", "forward"):
        if mode == "engine":
            formed.clear()
        sync(device)
        t0 = time.perf_counter()
        run_forward() if mode == "forward" else run_engine()
        sync(device)
        dt = time.perf_counter() - t0
        times[mode] = min(times.get(mode, dt), dt)
        clear_dump_dir(dump_dir)
        if mode == "engine":
            replay = list(formed)
    model.forward_batch = real_forward
    writer.close()
    return {
        "workload": spec,
        "requests": len(seqs),
        "tokens": tokens,
        "forward_batches": len(groups),
        "engine_mean_batch": round(2 * len(seqs) / max(engine.batches - batches0, 1), 2),
        "forward_only_tok_s": round(tokens / times["forward"], 1),
        "with_dumps_tok_s": round(tokens / times["engine"], 1),
        "ratio": round(times["forward"] / times["engine"], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument(
        "--varlen",
        action="store_true",
        help="also time forwards of varying lengths (64-512) against a fixed one",
    )
    ap.add_argument("--dump-root", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--workloads", default="", help="batched: LO-HI:COUNT,... (see above)")
    ap.add_argument("--batch-requests", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument(
        "--warmup-shapes",
        action="store_true",
        help="run every padded batch shape once first (else the engine meets new shapes "
        "that the forward-only replay has already seen)",
    )
    ap.add_argument("--clients", type=int, default=16, help="requests kept in flight")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load_model(
        args.model, device=args.device, dtype=dtype, dump_dtype=torch.bfloat16, layers=None
    )
    dump_dir = Path(tempfile.mkdtemp(prefix="hsq-dumpcost-", dir=args.dump_root))
    lengths = [int(x) for x in args.lengths.split(",") if x]
    per_token = (len(model.layer_ids) + 1) * model.hidden_size * 2
    if args.varlen:
        varlen_probe(model, args.device)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in lengths:
        writer = DumpWriter(
            dump_dir,
            depth=2,
            fsync=False,
            device=model.device,
            max_bytes=max(lengths) * per_token + 256,
        )
        engine = Engine(model, writer, FaultPlan(), max_tokens=1 << 20)
        ids = torch.randint(0, model.vocab_size, (n,), generator=gen).tolist()
        for _ in range(2):  # warm-up: kernels, allocator, pinned host cache
            model.forward(ids)
            engine.generate(ids)
        writer.flush()
        clear_dump_dir(dump_dir)
        times: dict[str, float] = {}
        # interleaved, best of two; "copy" = forward + device-to-host copy, no file write
        for mode in ("forward", "copy", "engine", "forward", "copy", "engine"):
            pending = None
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                if mode == "forward":
                    model.forward(ids)
                elif mode == "copy":
                    cap = model.forward(ids)
                    if pending is not None:  # release the previous buffer once its copy landed
                        pending.wait()
                        writer.release(pending)
                    pending = writer.to_host({"aux": cap.aux, "last": cap.last})
                else:
                    engine.generate(ids)
            if pending is not None:
                pending.wait()
                writer.release(pending)
            sync(args.device)
            writer.flush()
            dt = (time.perf_counter() - t0) / args.repeats
            times[mode] = min(times.get(mode, dt), dt)
            clear_dump_dir(dump_dir)
        writer.close()
        rows.append(
            {
                "tokens": n,
                "forward_ms": round(times["forward"] * 1e3, 2),
                "with_copy_ms": round(times["copy"] * 1e3, 2),
                "with_dump_ms": round(times["engine"] * 1e3, 2),
                "copy_overhead": round(times["copy"] / times["forward"] - 1, 4),
                "dump_overhead": round(times["engine"] / times["forward"] - 1, 4),
                "prefill_tok_s": round(n / times["forward"], 1),
                "dump_gb_s": round(
                    n * (len(model.layer_ids) + 1) * model.hidden_size * 2 / times["engine"] / 1e9,
                    3,
                ),
            }
        )
    print(f"server-side dump cost: {args.model} on {args.device}")
    print(
        f"{'tokens':>7} {'forward ms':>11} {'+copy ms':>9} {'+dump ms':>9} "
        f"{'copy':>7} {'dump':>7} {'prefill tok/s':>14}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['forward_ms']:>11} "
            f"{r['with_copy_ms']:>9} {r['with_dump_ms']:>9} {r['copy_overhead']:>7.2%} "
            f"{r['dump_overhead']:>7.2%} {r['prefill_tok_s']:>14,.0f}"
        )
    brows = [
        batched(model, args.device, dump_dir, w, args, per_token)
        for w in filter(None, args.workloads.split(","))
    ]
    if brows:
        print(
            f"batched ({args.clients} in flight, <= {args.batch_requests} requests and "
            f"{args.batch_tokens} padded tokens per forward)"
        )
        for b in brows:
            print(
                f"  {b['workload']:>14}: forward only {b['forward_only_tok_s']:>10,.0f} tok/s, "
                f"with dumps {b['with_dumps_tok_s']:>10,.0f} tok/s, ratio {b['ratio']:.3f} "
                f"(mean batch {b['engine_mean_batch']})"
            )
    print(
        json.dumps(
            {"dump_cost": rows, "batched": brows, "model": args.model, "device": args.device}
        )
    )


if __name__ == "__main__":
    main()
