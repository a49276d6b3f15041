"""Queue cost by job granularity: Redis commands per sample and samples/s, side by side.

For each chunk size, one run of the same short samples through a private redis-server,
one reference server (tiny model) and one `hsq worker --burst`; commands are counted with
INFO commandstats around the worker's run. Short samples keep the model's share small, so
the queue's overhead shows.

    .venv/bin/python -m bench.queue_granularity --samples 400 --sizes 1,4,16,64
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from pathlib import Path

from hsq.node.procs import RedisServer, ReferenceServer, worker_process
from hsq.producer.enqueue import enqueue_run
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect, redis_calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsq-bench-gran-"))
    redis_srv = RedisServer(work / "redis", password=secrets.token_hex(8)).wait_ready()
    server = ReferenceServer(work / "dumps", work / "server.log", args=["--no-fsync"])
    rows = []
    try:
        server.wait_ready()
        ds = work / "data.jsonl"
        write_synthetic(ds, args.samples, min_len=args.tokens, max_len=args.tokens)
        client = connect(redis_srv.url)
        for size in (int(x) for x in args.sizes.split(",")):
            run = f"gran{size}"
            store = RunStore(client, run)
            enqueue_run(
                store,
                RunConfig(run=run, dataset=str(ds), out=str(work / "out"), chunk_size=size),
                progress=False,
            )
            c0 = redis_calls(client)
            t0 = time.perf_counter()
            w = worker_process(
                run, server.url, server.dump_dir, redis_srv.url, work / f"w{size}.log", "--burst"
            )
            rc = w.proc.wait(600)
            elapsed = time.perf_counter() - t0
            calls = redis_calls(client) - c0 - 1
            done = store.count(store.keys.done)
            rows.append(
                {
                    "chunk_size": size,
                    "samples": done,
                    "rc": rc,
                    "redis_cmds_per_sample": round(calls / max(done, 1), 2),
                    "samples_per_s": round(done / elapsed, 1),
                }
            )
    finally:
        server.stop()
        redis_srv.stop()
    print(f"{'chunk':>6} {'samples':>8} {'cmds/sample':>12} {'samples/s':>10}")
    for r in rows:
        print(
            f"{r['chunk_size']:>6} {r['samples']:>8} {r['redis_cmds_per_sample']:>12} "
            f"{r['samples_per_s']:>10}"
        )
    print(json.dumps({"granularity": rows}))


if __name__ == "__main__":
    main()
