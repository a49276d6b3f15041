"""Redis capacity: the queue's per-sample command sequence, without servers or disks.

Worker processes claim chunks, check done, mark the samples done (the same script call as a
real worker's committer: one per `--batch` samples, or one per sample with `--per-sample`)
and finish the chunk, as fast as they can, against a private redis-server. Redis's own CPU
time (INFO cpu) gives the capacity at one saturated core.

    .venv/bin/python -m bench.redis_capacity --samples 40000 --procs 3 --chunk 64 --batch 64
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import tempfile
import time
from pathlib import Path

from hsq.dataset.jsonl import IndexEntry
from hsq.node.procs import RedisServer
from hsq.outputs.format import output_relpath
from hsq.outputs.manifest import ManifestEntry
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import chunked, connect, redis_calls

RUN = "cap"


def work(url: str, wid: int, batch: int) -> int:
    """batch 0: one mark_done call per sample."""
    store = RunStore(connect(url), RUN)
    worker = f"cap{wid}"
    n = 0
    while (job := store.claim(worker, 1)) is not None:
        done = store.done_among([sid for sid, _ in job.samples])
        todo = [
            (
                sid,
                ManifestEntry(
                    output_relpath(sid), e.num_tokens, 1000, "crc32:0", worker, time.time(), 0
                ),
            )
            for sid, e in job.samples
            if sid not in done
        ]
        if batch:
            for i in range(0, len(todo), batch):
                store.mark_done_many(todo[i : i + batch])
        else:
            for sid, entry in todo:
                store.mark_done(sid, entry)
        n += len(todo)
        store.finish(worker, job)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40000)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="samples per mark_done_many call")
    ap.add_argument("--per-sample", action="store_true", help="one mark_done call per sample")
    ap.add_argument("--tokens", type=int, default=300, help="tokens per sample")
    args = ap.parse_args()
    batch = 0 if args.per_sample else args.batch
    work_dir = Path(tempfile.mkdtemp(prefix="hsq-cap-"))
    srv = RedisServer(work_dir / "redis", password=secrets.token_hex(8)).wait_ready()
    try:
        client = connect(srv.url)
        store = RunStore(client, RUN)
        store.create_config(RunConfig(run=RUN, dataset="/dev/null", out="/tmp"))
        refs = [(f"s{i:07d}", IndexEntry(0, 1, 0, args.tokens)) for i in range(args.samples)]
        store.enqueue(chunked(refs, args.chunk))
        info0 = client.info("cpu")
        c0 = redis_calls(client)
        t0 = time.perf_counter()
        with mp.Pool(args.procs) as pool:
            done = sum(pool.starmap(work, [(srv.url, i, batch) for i in range(args.procs)]))
        wall = time.perf_counter() - t0
        info1 = client.info("cpu")
        calls = redis_calls(client) - c0 - 1
    finally:
        srv.stop()
    cpu = sum(float(info1[k]) - float(info0[k]) for k in ("used_cpu_user", "used_cpu_sys"))
    row = {
        "samples": done,
        "chunk": args.chunk,
        "batch": batch or "per-sample",
        "client_procs": args.procs,
        "samples_per_s": round(done / wall, 1),
        "redis_cmds_per_sample": round(calls / done, 2),
        "redis_cpu_s": round(cpu, 2),
        "redis_core_util": round(cpu / wall, 3),
        "capacity_samples_per_s_at_one_core": round(done / cpu, 1),
    }
    print(
        f"{done} samples in {wall:.1f} s by {args.procs} client processes: "
        f"{row['samples_per_s']:,.0f} samples/s, Redis busy {row['redis_core_util']:.0%} of a "
        f"core, {row['redis_cmds_per_sample']} commands/sample -> about "
        f"{row['capacity_samples_per_s_at_one_core']:,.0f} samples/s per saturated Redis core"
    )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
