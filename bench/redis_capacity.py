"""Redis capacity: the queue's per-sample command sequence, without servers or disks.

Worker processes claim chunks, check done, mark every sample done (the same Lua call as a
real worker) and finish the chunk, as fast as they can, against a private redis-server.
Redis's own CPU time (INFO cpu) gives the capacity at one saturated core.

    .venv/bin/python -m bench.redis_capacity --samples 40000 --procs 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import tempfile
import time
from pathlib import Path

from hsq.dataset import IndexEntry
from hsq.harness.procs import RedisServer
from hsq.outputs import ManifestEntry
from hsq.runconfig import RunConfig
from hsq.store import RunStore, chunked, connect, redis_calls

RUN = "cap"


def work(url: str, wid: int) -> int:
    store = RunStore(connect(url), RUN)
    worker = f"cap{wid}"
    n = 0
    while (job := store.claim(worker, 1)) is not None:
        done = store.done_among([sid for sid, _ in job.samples])
        for sid, e in job.samples:
            if sid not in done:
                store.mark_done(
                    sid,
                    ManifestEntry(
                        f"x/{sid}", e.num_tokens, 1000, "crc32:0", worker, time.time(), 0
                    ),
                )
                n += 1
        store.finish(worker, job)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40000)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--procs", type=int, default=3)
    args = ap.parse_args()
    work_dir = Path(tempfile.mkdtemp(prefix="hsq-cap-"))
    srv = RedisServer(work_dir / "redis", password=secrets.token_hex(8)).wait_ready()
    try:
        client = connect(srv.url)
        store = RunStore(client, RUN)
        store.save_config(RunConfig(run=RUN, dataset="/dev/null", out="/tmp"))
        refs = [(f"s{i:07d}", IndexEntry(0, 1, 0, 512)) for i in range(args.samples)]
        store.enqueue(chunked(refs, args.chunk))
        info0 = client.info("cpu")
        c0 = redis_calls(client)
        t0 = time.perf_counter()
        with mp.Pool(args.procs) as pool:
            done = sum(pool.starmap(work, [(srv.url, i) for i in range(args.procs)]))
        wall = time.perf_counter() - t0
        info1 = client.info("cpu")
        calls = redis_calls(client) - c0 - 1
    finally:
        srv.stop()
    cpu = sum(float(info1[k]) - float(info0[k]) for k in ("used_cpu_user", "used_cpu_sys"))
    row = {
        "samples": done,
        "chunk": args.chunk,
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
