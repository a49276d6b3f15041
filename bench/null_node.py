"""A node's worth of workers on one host: N null-model servers and N `hsq worker`s writing
one run to one output disk, bf16 and server-made fp8 side by side.

The servers' model costs nothing (tests.support.nullserver), so what limits the aggregate is
the workers' CPU and the output disk: it reports the aggregate GB/s and tokens/s against
the disk's best durable rate (bench/disk.py, probed in the same run), and each worker's CPU
time (its persist processes included, from wait4) beside the wall time.

    python -m bench.node --null --workers 8 --out-root /root --json-out node.json
    .venv/bin/python -m bench.null_node --workers 2 --samples-per-worker 12   # CPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ceiling import WORKLOADS, _events, _ts
from bench.disk import probe
from hsq.node.procs import RedisServer, hsq_command
from hsq.producer.enqueue import enqueue_run
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect
from tests.support.nullserver import SHAPES
from tests.support.procs import NullServer

TARGET_RATIO_TO_DISK = 0.9
ENCODINGS = {"bf16": ("plain", "bf16"), "fp8-server": ("fp8-e4m3", "fp8-e4m3")}
"""case -> (the servers' dump encoding, the run's store dtype)."""


def run_node(
    case: str, args: argparse.Namespace, work: Path, dump_root: Path, out_root: Path, url: str
) -> dict[str, Any]:
    encoding, store_dtype = ENCODINGS[case]
    lo, hi = WORKLOADS[args.workload]
    n = args.workers
    run = f"node-{case}-{secrets.token_hex(2)}"
    ds = work / f"{run}.jsonl"
    write_synthetic(ds, n * args.samples_per_worker, seed=5, min_len=lo, max_len=hi, vocab=32000)
    out = out_root / run
    cfg = RunConfig(run=run, dataset=str(ds), out=str(out), store_dtype=store_dtype)
    enqueue_run(RunStore(connect(url), run), cfg, progress=False)
    servers = [
        NullServer(
            dump_root / f"{case}-{i}",
            work / f"{run}-server{i}.log",
            args=["--shape", args.shape, "--max-tokens", str(hi), "--dump-encoding", encoding],
        )
        for i in range(n)
    ]
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    usage: list[dict[str, float]] = []
    try:
        for s in servers:
            s.wait_ready(timeout=300)
        t0 = time.time()
        for i, s in enumerate(servers):
            log = work / f"{run}-w{i}.log"
            argv = hsq_command(
                "worker", "--run", run, "--server", s.url, "--dump-dir", str(s.dump_dir),
                "--burst", "--inflight", str(args.inflight),
                "--persist-procs", str(args.persist_procs),
            )  # fmt: skip
            with open(log, "wb") as f:
                env = {**os.environ, "PYTHONUNBUFFERED": "1", "HSQ_REDIS_URL": url}
                procs.append(
                    (subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env), log)
                )
        for p, _log in procs:
            _pid, status, ru = os.wait4(p.pid, 0)  # the worker's own CPU and its children's
            p.returncode = os.waitstatus_to_exitcode(status)
            usage.append({"cpu_s": ru.ru_utime + ru.ru_stime, "rc": p.returncode})
        wall = time.time() - t0
    finally:
        for p, _log in procs:
            if p.poll() is None:
                p.kill()
        for s in servers:
            s.stop()
    done = [e for _p, log in procs for e in _events(log) if e.get("event") == "sample_done"]
    bad = [u for u in usage if u["rc"] != 0]
    if bad or not done:
        raise RuntimeError(f"{case}: workers exited {[u['rc'] for u in usage]}, {len(done)} done")
    done.sort(key=lambda e: _ts(e["timestamp"]))
    times = [_ts(e["timestamp"]) for e in done]
    window = max(times[-1] - times[0], 1e-9)
    steady = len(done) - 1  # what finished inside the window
    nbytes = sum(int(e["bytes"]) for e in done) * steady / len(done)
    tokens = sum(int(e["tokens"]) for e in done) * steady / len(done)
    # The middle 80 % of the samples: the start (workers and pipes filling) and the tail
    # (workers that ran out of work while others still write) left out.
    lo_i, hi_i = len(done) // 10, len(done) - 1 - len(done) // 10
    mid_s = max(times[hi_i] - times[lo_i], 1e-9)
    mid_bytes = sum(int(e["bytes"]) for e in done[lo_i + 1 : hi_i + 1])
    shutil.rmtree(out, ignore_errors=True)
    ds.unlink(missing_ok=True)
    cpu = [u["cpu_s"] for u in usage]
    return {
        "case": case,
        "shape": args.shape,
        "workload": f"{lo}-{hi}",
        "workers": n,
        "persist_procs_per_worker": args.persist_procs,
        "samples": len(done),
        "wall_s": round(wall, 2),
        "window_s": round(window, 2),
        "gb_s": round(nbytes / window / 1e9, 3),
        "mid80_s": round(mid_s, 2),
        "mid80_gb_s": round(mid_bytes / mid_s / 1e9, 3),
        "tok_s": round(tokens / window, 1),
        "samples_s": round(steady / window, 2),
        "bytes_per_token": round(
            sum(int(e["bytes"]) for e in done) / sum(int(e["tokens"]) for e in done), 1
        ),
        "cpu_s_per_worker_mean": round(sum(cpu) / len(cpu), 2),
        "cpu_s_per_worker_max": round(max(cpu), 2),
        "cpu_cores_per_worker": round(sum(cpu) / len(cpu) / wall, 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8, help="null servers, one worker each")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--workload", default="long", choices=sorted(WORKLOADS))
    ap.add_argument("--samples-per-worker", type=int, default=24)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument(
        "--persist-procs",
        type=int,
        default=None,
        help="per worker [default: the cores shared out, at least 1]",
    )
    ap.add_argument("--cases", default="bf16,fp8-server", help=", ".join(ENCODINGS))
    ap.add_argument("--dump-root", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--out-root", default=None, help="the output disk [default: a temp dir]")
    ap.add_argument("--disk-mb", type=int, default=1024, help="data per disk design (0: skip)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--null", action="store_true", help=argparse.SUPPRESS)  # bench.node --null
    args = ap.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    if args.persist_procs is None:
        args.persist_procs = max(1, cpus // args.workers)
    work = Path(tempfile.mkdtemp(prefix="hsq-node-"))
    dump_root = Path(tempfile.mkdtemp(prefix="hsq-node-dumps-", dir=args.dump_root))
    out_root = Path(tempfile.mkdtemp(prefix="hsq-node-out-", dir=args.out_root))
    redis_srv = RedisServer(work / "redis", password=secrets.token_hex(8)).wait_ready()
    rows = []
    try:
        for case in [c for c in args.cases.split(",") if c]:
            row = run_node(case, args, work, dump_root, out_root, redis_srv.url)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        redis_srv.stop()
    disk: dict[str, Any] = dict(probe(out_root / "bw", args.disk_mb)) if args.disk_mb > 0 else {}
    best = float(disk.get("best_bytes_s", 0.0)) / 1e9
    print(
        f"\nhsq node (null-model servers): {platform.node()} {cpus} cpus, disk best {best:.3f} GB/s"
    )
    for r in rows:
        r["disk_best_gb_s"] = round(best, 3) if best else None
        r["ratio_to_disk"] = round(r["gb_s"] / best, 3) if best else None
        r["mid80_ratio_to_disk"] = round(r["mid80_gb_s"] / best, 3) if best else None
        verdict = (
            "" if not best else ("met" if r["ratio_to_disk"] >= TARGET_RATIO_TO_DISK else "MISSED")
        )
        r["target"] = f">= {TARGET_RATIO_TO_DISK} of the disk's best: {verdict}"
        print(
            f"  {r['case']:<11} {r['workers']} workers x {r['persist_procs_per_worker']} procs: "
            f"{r['gb_s']:.3f} GB/s ({r['ratio_to_disk']} of disk, target {TARGET_RATIO_TO_DISK}: "
            f"{verdict}; middle 80 %: {r['mid80_gb_s']:.3f} GB/s, {r['mid80_ratio_to_disk']}), "
            f"{r['tok_s']:,.0f} tok/s, {r['bytes_per_token']:.0f} B/token, "
            f"CPU {r['cpu_cores_per_worker']} cores per worker"
        )
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {cpus} cpus",
        "disk": {k: v for k, v in disk.items() if k != "designs"},
        "rows": rows,
    }
    print(json.dumps(result))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(out_root, ignore_errors=True)
    shutil.rmtree(dump_root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
