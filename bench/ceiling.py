"""The worker's ceiling: one `hsq worker --burst` against a server whose model costs nothing.

A null-model server (tests.support.nullserver) answers /generate at once and writes a valid
dump of the chosen shape from a preallocated buffer; a real redis-server holds the run; one
real worker process extracts it to --out-root. Per run (shape x workload x store dtype):

  steady     tokens, samples and bytes between the first and the last `sample_done`
  startup    worker process start -> the server's first /generate (started_s: -> the
             worker's `worker_started` line)
  exit       the last `sample_done` -> the worker process has exited
  redis      commands per sample (INFO commandstats around the worker's run)
  rss        the worker's peak RSS
  stages     per sample, from the worker's `sample_done` lines: request, wait for the dump,
             validate, and inside the write: read, finite check, checksum, quantize,
             write, fsync (file and directory), mark done in Redis

and, once per invocation, the output disk's best durable rate (bench/disk.py) with the
ratio of each run's GB/s to it. Each case runs once per `--procs` value (the worker's
`--persist-procs`: 0 is one interpreter, persist threads only), side by side; `cpu_s` is
the worker's CPU time (its persist processes included) beside its wall time.

Store dtypes: bf16, fp8-e4m3 (quantized by the worker) and fp8-server (fp8-e4m3 made by
the null server, `--dump-encoding fp8-e4m3`, copied by the worker).

    .venv/bin/python -m bench.ceiling --small                  # CPU machine (make bench)
    python -m bench.ceiling --out-root /root --dump-root /dev/shm  # H200: see BENCHMARKS.md

Prints a table and one JSON line per run; `--json-out` writes them with the targets
(the targets: >= 400 samples/s short and >= 0.9 of the disk's best on long, bf16).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.disk import probe
from hsq.node.procs import RedisServer, hsq_command
from hsq.producer.enqueue import enqueue_run
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect, redis_calls
from hsq.workers.persist.procs import default_procs
from tests.support.nullserver import SHAPES
from tests.support.procs import NullServer

WORKLOADS = {"short": (64, 512), "long": (1024, 4096)}
FP8_SERVER = "fp8-server"
"""A case's dtype: the run stores fp8-e4m3 that the null server made (not the worker)."""
TARGET_SHORT_SAMPLES_S = 400.0
TARGET_LONG_RATIO_TO_DISK = 0.9
STAGES = (
    "request_ms",
    "wait_ms",
    "validate_ms",
    "read_ms",
    "finite_ms",
    "checksum_ms",
    "quantize_ms",
    "write_ms",
    "fsync_ms",
    "check_ms",
    "mark_ms",
    "persist_ms",
)


@dataclass(frozen=True)
class Case:
    shape: str
    workload: str
    store_dtype: str
    samples: int
    inflight: int
    procs: int = 0


def _ts(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def run_case(
    case: Case,
    server: NullServer,
    redis_url: str,
    work: Path,
    out_root: Path,
    extra: list[str],
    profile: Path | None = None,
) -> dict[str, Any]:
    lo, hi = WORKLOADS[case.workload]
    shape = case.shape.replace(".", "")  # run names hold no dots (kimi-k2.5)
    store_dtype = "fp8-e4m3" if case.store_dtype == FP8_SERVER else case.store_dtype
    run = f"ceil-{shape}-{case.workload}-{case.store_dtype}-p{case.procs}-{secrets.token_hex(2)}"
    ds = work / f"{run}.jsonl"
    write_synthetic(ds, case.samples, seed=11, min_len=lo, max_len=hi, vocab=32000)
    client = connect(redis_url)
    store = RunStore(client, run)
    out = out_root / run
    cfg = RunConfig(run=run, dataset=str(ds), out=str(out), store_dtype=store_dtype)
    enqueue_run(store, cfg, progress=False)
    httpx.post(server.url + "/admin/reset", timeout=10).raise_for_status()
    log = work / f"{run}.log"
    argv = hsq_command(
        "worker",
        "--run",
        run,
        "--server",
        server.url,
        "--dump-dir",
        str(server.dump_dir),
        "--redis",
        redis_url,
        "--burst",
        "--inflight",
        str(case.inflight),
        "--persist-procs",
        str(case.procs),
        *extra,
    )
    if profile is not None:  # py-spy samples the worker: collapsed stacks, one file per run
        profile.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(argv[0]).with_name("py-spy"))
        rate = os.environ.get("HSQ_PROFILE_RATE", "250")
        rec = [spy, "record", "--format", "raw", "--rate", rate, "--threads"]
        rec += ["--gil"] if os.environ.get("HSQ_PROFILE_GIL") == "1" else []
        # py-spy pauses the worker for every sample unless told not to: at 100+ Hz on a
        # few cores that halves its rate (measured: 57 -> 27 samples/s on 2 cores).
        rec += ["--nonblocking"] if os.environ.get("HSQ_PROFILE_BLOCKING") != "1" else []
        argv = [*rec, "-o", str(profile / f"{run}.txt"), "--", *argv]
    c0 = redis_calls(client)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t_spawn = time.time()
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        rc = proc.wait(3600)
    t_exit = time.time()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker and its persist procs
    cpu_s = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    calls = redis_calls(client) - c0 - 1  # less the INFO of the second look
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    events = _events(log)
    done = [e for e in events if e.get("event") == "sample_done"]
    stopped = [e for e in events if e.get("event") == "worker_stopped"]
    if rc != 0 or not done:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"worker exited {rc} with {len(done)} samples done:\n{tail}")
    done.sort(key=lambda e: _ts(e["timestamp"]))
    t_first, t_last = _ts(done[0]["timestamp"]), _ts(done[-1]["timestamp"])
    window = max(t_last - t_first, 1e-9)
    steady = done[1:]  # what finished inside the window
    tokens = sum(int(e["tokens"]) for e in steady)
    nbytes = sum(int(e["bytes"]) for e in steady)
    stages: dict[str, float] = {}
    for key in STAGES:
        vals = [float(e[key]) for e in done if key in e]
        if vals:
            stages[key] = round(statistics.median(vals), 3)
    first_req = info.get("first_request_unix")
    started = [e for e in events if e.get("event") == "worker_started"]
    shutil.rmtree(out, ignore_errors=True)
    ds.unlink(missing_ok=True)
    return {
        "shape": case.shape,
        "hidden_size": SHAPES[case.shape][0],
        "workload": f"{lo}-{hi}",
        "store_dtype": case.store_dtype,
        "samples": case.samples,
        "done": len(done),
        "inflight": case.inflight,
        "persist_procs": case.procs,
        "wall_s": round(t_exit - t_spawn, 2),
        "cpu_s": round(cpu_s, 2),
        "cpu_ms_per_sample": round(cpu_s * 1e3 / len(done), 2),
        "tok_s": round(tokens / window, 1),
        "samples_s": round(len(steady) / window, 2),
        "gb_s": round(nbytes / window / 1e9, 3),
        "bytes_per_token": round(
            sum(int(e["bytes"]) for e in done) / sum(int(e["tokens"]) for e in done), 1
        ),
        "startup_s": round(first_req - t_spawn, 3) if first_req else None,
        "started_s": round(_ts(started[0]["timestamp"]) - t_spawn, 3) if started else None,
        "exit_s": round(t_exit - t_last, 3),
        "redis_cmds_per_sample": round(calls / len(done), 2),
        "worker_peak_rss_mb": stopped[0].get("peak_rss_mb") if stopped else None,
        # The worker's own interpreter, its persist processes not counted: the serial part.
        "worker_own_cpu_ms_per_sample": (
            round(float(stopped[0]["cpu_s"]) * 1e3 / len(done), 2)
            if stopped and "cpu_s" in stopped[0]
            else None
        ),
        "stage_median_ms": stages,
    }


def run_cases(
    args: argparse.Namespace, work: Path, dump_root: Path, out_root: Path
) -> list[dict[str, Any]]:
    """Every case, each with every --procs value; one null server per shape and encoding."""
    shapes = [s for s in args.shapes.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    dtypes = [d for d in args.dtypes.split(",") if d]
    extra = list(args.worker_arg)
    if args.persist_threads:
        extra += ["--persist-threads", str(args.persist_threads)]
    procs_list = [int(p) for p in args.procs.split(",") if p]
    redis_srv = RedisServer(work / "redis", password=secrets.token_hex(8)).wait_ready()
    rows: list[dict[str, Any]] = []
    threads = args.persist_threads
    # One server per shape and dump encoding: plain (bf16, fp8 by the worker), fp8 made there.
    groups = [
        (enc, [d for d in dtypes if (d == FP8_SERVER) == (enc == "fp8-e4m3")])
        for enc in ("plain", "fp8-e4m3")
    ]
    try:
        for shape in shapes:
            max_tokens = max(hi for w, (_lo, hi) in WORKLOADS.items() if w in workloads)
            for enc, enc_dtypes in groups:
                if not enc_dtypes:
                    continue
                server = NullServer(
                    dump_root / f"d-{shape}-{enc}",
                    work / f"server-{shape}-{enc}.log",
                    args=[
                        "--shape",
                        shape,
                        "--max-tokens",
                        str(max_tokens),
                        "--dump-encoding",
                        enc,
                    ],
                )
                try:
                    server.wait_ready(timeout=300)
                    for wl in workloads:
                        for dtype in enc_dtypes:
                            for nprocs in procs_list:
                                n = args.short_samples if wl == "short" else args.long_samples
                                k = args.short_inflight if wl == "short" else args.long_inflight
                                case = Case(shape, wl, dtype, n, k, nprocs)
                                res = run_case(
                                    case, server, redis_srv.url, work, out_root, extra, args.profile
                                )
                                res["persist_threads"] = threads or "default"
                                rows.append(res)
                                print(json.dumps(res), flush=True)
                                if args.json_out is not None:  # a killed run keeps its rows
                                    args.json_out.write_text(
                                        json.dumps({"partial": True, "rows": rows}, indent=1)
                                    )
                finally:
                    server.stop()
    finally:
        redis_srv.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8b,kimi-k2.5", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--workloads", default="short,long", help="short (64-512), long (1024-4096)")
    ap.add_argument(
        "--dtypes",
        default=f"bf16,fp8-e4m3,{FP8_SERVER}",
        help="store dtypes (fp8-server: made by the server)",
    )
    ap.add_argument(
        "--procs",
        default=f"0,{max(2, default_procs())}",
        help="--persist-procs values to run each case with, side by side [default: 0 and the "
        "worker's default on this machine, at least 2]",
    )
    ap.add_argument("--json-out", type=Path, default=None, help="write rows and targets here")
    ap.add_argument("--short-samples", type=int, default=800)
    ap.add_argument("--long-samples", type=int, default=200)
    ap.add_argument("--short-inflight", type=int, default=16)
    ap.add_argument("--long-inflight", type=int, default=8)
    ap.add_argument("--persist-threads", type=int, default=None, help="[default: the worker's]")
    ap.add_argument("--worker-arg", action="append", default=[], help="more `hsq worker` flags")
    ap.add_argument(
        "--small",
        action="store_true",
        help="CPU-machine sizes: 8b shape only, 120 short and 24 long samples, 256 MB disk probe",
    )
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny shape, 12 samples")
    ap.add_argument(
        "--dump-root",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="where the dump dir lives (tmpfs, as in production)",
    )
    ap.add_argument("--out-root", default=None, help="output disk [default: a temp dir]")
    ap.add_argument("--disk-mb", type=int, default=1024, help="data per disk design (0: skip)")
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="py-spy each worker; stacks into this dir (HSQ_PROFILE_GIL=1: GIL holders only)",
    )
    args = ap.parse_args()
    if args.small:
        args.shapes, args.short_samples, args.long_samples = "8b", 120, 24
        args.disk_mb = min(args.disk_mb, 256)
    if args.smoke:
        args.shapes, args.short_samples, args.long_samples, args.disk_mb = "tiny", 12, 6, 0
    work = Path(tempfile.mkdtemp(prefix="hsq-ceiling-"))
    dump_root = Path(tempfile.mkdtemp(prefix="hsq-ceiling-dumps-", dir=args.dump_root))
    out_root = Path(tempfile.mkdtemp(prefix="hsq-ceiling-out-", dir=args.out_root))
    rows = run_cases(args, work, dump_root, out_root)
    disk: dict[str, Any] = {}
    if args.disk_mb > 0:
        disk = probe(out_root / "bw", args.disk_mb)
    best = float(disk.get("best_bytes_s", 0.0)) / 1e9
    stamp = {
        "label": args.label or "ceiling",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {os.cpu_count()} cpus",
        "disk_best_gb_s": round(best, 3) if best else None,
        "disk_best_design": disk.get("best"),
    }
    print_table(rows, disk, stamp, best)
    verdicts = targets(rows)
    for v in verdicts:
        print(f"  target {v['what']}: {v['value']} (target {v['target']}) {v['verdict']}")
    shutil.rmtree(out_root, ignore_errors=True)
    shutil.rmtree(dump_root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    # No rows again here: each was printed as JSON when its case ended (a killed run keeps them).
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({**stamp, "rows": rows, "targets": verdicts}, indent=1))


def print_table(
    rows: list[dict[str, Any]], disk: dict[str, Any], stamp: dict[str, Any], best: float
) -> None:
    print(f"\nhsq ceiling (null-model server, one worker): {stamp['machine']}")
    if disk:
        print("  disk, durable GB/s:", ", ".join(f"{k} {v}" for k, v in disk["gb_s"].items()))
    print(
        f"  {'shape':<10} {'workload':<10} {'dtype':<10} {'procs':>5} {'tok/s':>10} "
        f"{'samples/s':>9} "
        f"{'GB/s':>6} {'/disk':>6} {'cpu s':>6} {'wall s':>6} {'start s':>7} {'exit s':>6} "
        f"{'Redis/s.':>8} {'RSS MB':>7}"
    )
    for r in rows:
        r.update(stamp)
        r["ratio_to_disk"] = round(r["gb_s"] / best, 3) if best else None
        print(
            f"  {r['shape']:<10} {r['workload']:<10} {r['store_dtype']:<10} "
            f"{r['persist_procs']:>5} "
            f"{r['tok_s']:>10,.0f} {r['samples_s']:>9.1f} {r['gb_s']:>6.3f} "
            f"{r['ratio_to_disk'] or 0:>6.3f} {r['cpu_s']:>6.1f} {r['wall_s']:>6.1f} "
            f"{r['startup_s'] or 0:>7.2f} {r['exit_s']:>6.2f} "
            f"{r['redis_cmds_per_sample']:>8.2f} {r['worker_peak_rss_mb'] or 0:>7.0f}"
        )
    print("  stage medians, ms per sample:")
    for r in rows:
        st = ", ".join(f"{k.removesuffix('_ms')} {v:g}" for k, v in r["stage_median_ms"].items())
        print(f"    {r['shape']} {r['workload']} {r['store_dtype']} p{r['persist_procs']}: {st}")


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worker-ceiling targets, per shape and --persist-procs, beside the figures."""
    out: list[dict[str, Any]] = []

    def find(shape: str, wl: str, dtype: str, procs: int) -> dict[str, Any] | None:
        lo, hi = WORKLOADS[wl]
        for r in rows:
            key = (r["shape"], r["workload"], r["store_dtype"], r["persist_procs"])
            if key == (shape, f"{lo}-{hi}", dtype, procs):
                return r
        return None

    def add(what: str, value: float | None, target: float) -> None:
        if value is not None:
            verdict = "met" if value >= target else "MISSED"
            out.append(
                {"what": what, "value": value, "target": f">= {target:g}", "verdict": verdict}
            )

    for shape, procs in sorted({(r["shape"], r["persist_procs"]) for r in rows}):
        tag = f"{shape} procs={procs}"
        short = find(shape, "short", "bf16", procs)
        long_ = find(shape, "long", "bf16", procs)
        add(
            f"{tag} short bf16 samples/s",
            None if short is None else float(short["samples_s"]),
            TARGET_SHORT_SAMPLES_S,
        )
        add(
            f"{tag} long bf16 GB/s / disk best",
            None
            if long_ is None or long_["ratio_to_disk"] is None
            else float(long_["ratio_to_disk"]),
            TARGET_LONG_RATIO_TO_DISK,
        )
        for wl in WORKLOADS:
            base = find(shape, wl, "bf16", procs)
            for dtype in ("fp8-e4m3", FP8_SERVER):
                r = find(shape, wl, dtype, procs)
                if base and r:
                    add(
                        f"{tag} {wl} {dtype} tok/s / bf16 tok/s",
                        round(r["tok_s"] / base["tok_s"], 3),
                        1.0,
                    )
    return out


if __name__ == "__main__":
    main()
