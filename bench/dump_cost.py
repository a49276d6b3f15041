"""Server-side dump cost: the reference engine's prefill with dumping vs the bare forward.

In one process, for each length: K forwards of the model alone, then K requests through
the engine (forward, cast, pinned async device-to-host copy, hand-off to the writer thread,
which writes the dump while the next forward runs), with the writer drained at the end.
The ratio is what dumping adds to prefill time.

    python bench/dump_cost.py --model llama-8b --device cuda --lengths 2048,8192
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hsq.protocol import clear_dump_dir
from sglang_server.reference.dumper import DumpWriter
from sglang_server.reference.engine import Engine
from sglang_server.reference.faults import FaultPlan
from sglang_server.reference.model import load_model


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--write-threads", default="4", help="comma list: one run per value")
    ap.add_argument(
        "--varlen",
        action="store_true",
        help="also time forwards of varying lengths (64-512) against a fixed one",
    )
    ap.add_argument("--dump-root", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load_model(
        args.model, device=args.device, dtype=dtype, dump_dtype=torch.bfloat16, layers=None
    )
    dump_dir = Path(tempfile.mkdtemp(prefix="hsq-dumpcost-", dir=args.dump_root))
    lengths = [int(x) for x in args.lengths.split(",")]
    per_token = (len(model.layer_ids) + 1) * model.hidden_size * 2
    if args.varlen:
        varlen_probe(model, args.device)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for threads, n in [(int(t), n) for t in args.write_threads.split(",") for n in lengths]:
        writer = DumpWriter(
            dump_dir,
            depth=2,
            fsync=False,
            device=model.device,
            max_bytes=max(lengths) * per_token + 256,
            write_threads=threads,
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
                "write_threads": threads,
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
        f"{'threads':>7} {'tokens':>7} {'forward ms':>11} {'+copy ms':>9} {'+dump ms':>9} "
        f"{'copy':>7} {'dump':>7} {'prefill tok/s':>14}"
    )
    for r in rows:
        print(
            f"{r['write_threads']:>7} {r['tokens']:>7} {r['forward_ms']:>11} "
            f"{r['with_copy_ms']:>9} {r['with_dump_ms']:>9} {r['copy_overhead']:>7.2%} "
            f"{r['dump_overhead']:>7.2%} {r['prefill_tok_s']:>14,.0f}"
        )
    print(json.dumps({"dump_cost": rows, "model": args.model, "device": args.device}))


if __name__ == "__main__":
    main()
