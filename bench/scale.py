"""Scale: one run of ten million samples, and the Redis traffic of a thousand servers (CPU).

Steps (each timed; the operator commands run as the real CLI, in a subprocess, so the
times include Python's start):

  gen        a JSONL dataset of --samples lines (ids unique, token lists from a pool)
  enqueue    `hsq enqueue`; Redis memory per sample after it (INFO memory)
  reenqueue  `hsq enqueue` again (nothing to enqueue)
  status     `hsq status --json` with every sample queued, then mid-run (half the samples
             done, 1% dead, jobs held by workers), and `hsq status --recount` (the slow path)
  requeue    `hsq requeue --failed` of the 1% dead
  verify     `hsq verify` (headers) of a run of --verify-files real output files (and with
             --verify-cold again after their pages are dropped from the page cache)
  recover    `hsq recover` of a run of --recover-files real output files, Redis purged
  capacity   bench/redis_capacity.py at chunk sizes --cap-chunks (commands per sample and
             samples/s per saturated Redis core)

    .venv/bin/python -m bench.scale                        # the full run (~1 h, ~8 GB disk)
    .venv/bin/python -m bench.scale --preset 10m --dataset /tmp/10m.jsonl  # the target sizes
    .venv/bin/python -m bench.scale --preset ci            # `make bench`: minutes
    .venv/bin/python -m bench.scale --samples 20000 --verify-files 2000 \\
        --recover-files 100 --cap-samples 5000             # a smoke run, seconds

Each timed command runs --repeat times (default 2: the machine may be shared) and reports
every run's wall time and CPU time (user + sys of the command and the processes it
started), and Redis's own CPU time beside it. The end prints the targets (10M-
line enqueue <= 60 s, verify of 1M outputs <= 60 s, status <= 1 s) beside the figures; at
a smaller size the time is also projected linearly to the target's size. Prints one JSON
object per step and a summary JSON at the end. Everything is written under --work (a fresh
/tmp directory by default) and removed unless --keep; --dataset keeps a generated dataset
(written there once, reused after).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.scale_outputs import evict_pages, make_outputs, mark
from hsq.node.procs import RedisServer, hsq_command
from hsq.outputs.format import output_relpath
from hsq.outputs.manifest import ManifestEntry
from hsq.runstore import RunStore
from hsq.store import connect

RUN = "scale"
STEPS = ("gen", "enqueue", "reenqueue", "status", "requeue", "verify", "recover", "capacity")
results: dict[str, Any] = {}


def report(step: str, **row: Any) -> None:
    results[step] = row
    print(json.dumps({"step": step, **row}), flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def children_cpu() -> float:
    """User + sys seconds of every finished child process (and the processes they waited)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measured(
    client: Any, repeat: int, fn: Callable[[int], subprocess.CompletedProcess[str]]
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """fn(i) (a command) `repeat` times: each run's wall and CPU seconds, Redis's CPU
    seconds, and the best wall time; the last run's process."""
    runs = []
    proc = None
    for i in range(repeat):
        cpu0, r0 = children_cpu(), redis_cpu(client)
        t0 = time.perf_counter()
        proc = fn(i)
        wall = time.perf_counter() - t0
        cpu, rcpu = children_cpu() - cpu0, redis_cpu(client) - r0
        runs.append(
            {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "redis_cpu_s": round(rcpu, 2)}
        )
    assert proc is not None
    best = min(r["wall_s"] for r in runs)
    return {"wall_s": best, "runs": runs}, proc


def hsq(*args: str, ok: tuple[int, ...] = (0, 1)) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(hsq_command(*args), capture_output=True, text=True)
    if proc.returncode not in ok:
        raise SystemExit(f"hsq {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


# ---------------------------------------------------------------------------- datasets
def write_dataset(path: Path, n: int, min_len: int, max_len: int, seed: int = 0) -> int:
    """n lines as json.dumps writes them; token lists come from a pool of 4096 (the parser's
    work is the same), ids are unique. Returns the file's size."""
    rng = random.Random(seed)
    pool = []
    for _ in range(4096):
        k = round(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))
        ids = ", ".join(str(rng.randrange(150000)) for _ in range(k))
        mask = ", ".join(["0"] * (k // 2) + ["1"] * (k - k // 2))
        pool.append(f'"input_ids": [{ids}], "loss_mask": [{mask}]}}\n')
    with open(path, "w", buffering=2**22) as f:
        for i in range(n):
            f.write(f'{{"id": "s{i:09d}", {pool[i & 4095]}')
    return path.stat().st_size


# ---------------------------------------------------------------------------- steps
def run_progress(url: str, n: int) -> None:
    """Mid-run state without servers: half the samples claimed and marked done, 1% of the
    rest dead-lettered, 64 jobs held by 8 workers."""
    store = RunStore(connect(url), RUN)
    store.require_config()
    done_target, dead_target = n // 2, n // 100
    done = dead = 0
    while done < done_target and (job := store.claim("bench-done", 1)) is not None:
        entries = [
            (sid, ManifestEntry(output_relpath(sid), e.num_tokens, 1000, "crc32:0", "b", 0.0, 0))
            for sid, e in job.samples
        ]
        mark(store, entries)
        store.finish("bench-done", job)
        done += len(entries)
    while dead < dead_target and (job := store.claim("bench-dead", 1)) is not None:
        for sid, _ in job.samples:
            store.to_dead(sid, "wrong_length", "bench", 3, "bench-dead")
        store.finish("bench-dead", job)
        dead += len(job.samples)
    for w in range(8):
        store.register(f"bench-w{w}", {"state": "working", "name": f"w{w}"})
        for _ in range(8):
            store.claim(f"bench-w{w}", 1)


def status_time(url: str, *extra: str, repeat: int = 1) -> dict[str, Any]:
    args = ("status", "--run", RUN, "--redis", url, "--json", *extra)
    times, proc = measured(connect(url), repeat, lambda _: hsq(*args, ok=(0, 1, 2)))
    if proc.returncode == 2:  # an hsq without this option (the "before" figures)
        return {"error": proc.stderr.strip().splitlines()[-1]}
    st = json.loads(proc.stdout)
    keys = ("total", "done", "queued", "in_progress", "retry", "dead", "missing")
    # The same call in this process: the command's time less Python's start.
    from hsq.ops import run_status

    store = RunStore(connect(url), RUN)
    store.require_config()
    inproc, _ = timed(lambda: run_status(store))
    return {**times, "in_process_s": round(inproc, 3), **{k: st[k] for k in keys}}


def time_enqueue(
    client: Any, enq: list[str], n: int, chunk: int, steps: set[str], rep: int
) -> None:
    """The enqueue steps: a first enqueue (each repeat into a run of its own) and again."""
    if "enqueue" in steps:
        mem0 = used_memory(client)
        mem1 = mem0

        def first_enqueue(i: int) -> subprocess.CompletedProcess[str]:
            # Each repeat is a first enqueue: of a run of its own (kept: a purge would be
            # timed with the next run).
            nonlocal mem1
            if i == 0:
                proc = hsq(*enq)
                mem1 = used_memory(client)
                return proc
            return hsq(*enq[:3], f"{RUN}-{i}", *enq[4:])

        times, proc = measured(client, rep, first_enqueue)
        report(
            "enqueue",
            samples=n,
            chunk=chunk or "default",
            output=proc.stdout.strip().splitlines()[-1],
            **times,
            lines_per_s=round(n / times["wall_s"]),
            redis_bytes_per_sample_queued=round((mem1 - mem0) / n, 1),
        )
    if "reenqueue" in steps:
        times, proc = measured(client, rep, lambda _: hsq(*enq))
        report(
            "reenqueue",
            **times,
            lines_per_s=round(n / times["wall_s"]),
            output=proc.stdout.strip().splitlines()[-1],
        )


def verify_step(
    args: argparse.Namespace, client: Any, work: Path, out: Path, url: str, rep: int
) -> None:
    """`hsq verify` of --verify-files real outputs: as it is, with each --verify-variant's
    flags, and (--verify-cold) after their pages are dropped."""
    vrun = "scale-verify"
    wall, _ = timed(lambda: make_outputs(work, vrun, args.verify_files, url))
    report("verify_setup", files=args.verify_files, wall_s=round(wall, 1))
    vcmd = ("verify", "--run", vrun, "--redis", url, "--no-progress")

    def timed_verify(
        step: str, fn: Callable[[int], subprocess.CompletedProcess[str]], **kw: Any
    ) -> None:
        times, proc = measured(client, rep, fn)
        report(
            step,
            **kw,
            files=args.verify_files,
            **times,
            files_per_s=round(args.verify_files / times["wall_s"]),
            output=proc.stdout.strip().splitlines()[0],
        )

    timed_verify("verify_headers", lambda _: hsq(*vcmd))
    for extra in args.verify_variant:  # the same files, other `hsq verify` flags
        flags = tuple(extra.split())

        def with_flags(_i: int, f: tuple[str, ...] = flags) -> subprocess.CompletedProcess[str]:
            return hsq(*vcmd, *f)

        timed_verify("verify_headers_variant", with_flags, flags=extra)
    if args.verify_cold:

        def cold(_i: int) -> subprocess.CompletedProcess[str]:
            evict_pages(out / vrun)  # not timed
            return hsq(*vcmd)

        timed_verify(
            "verify_headers_cold",
            cold,
            note="each run after the files' pages were dropped from the page cache",
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--min-tokens", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--chunk", type=int, default=16, help="--chunk-size; 0: hsq's default")
    ap.add_argument("--verify-files", type=int, default=1_000_000)
    ap.add_argument(
        "--verify-cold", action="store_true", help="verify again after dropping the files' pages"
    )
    ap.add_argument(
        "--verify-variant",
        action="append",
        default=[],
        help="also time `hsq verify` with these flags (e.g. '--read-threads 1'); repeatable",
    )
    ap.add_argument("--recover-files", type=int, default=20_000)
    ap.add_argument("--cap-samples", type=int, default=200_000)
    ap.add_argument("--cap-chunks", default="16,64,256")
    ap.add_argument("--cap-procs", type=int, default=3)
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each timed command")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="sizes for a named run")
    ap.add_argument("--dataset", type=Path, default=None, help="generated once, then reused")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    for name, value in PRESETS.get(args.preset, {}).items():
        setattr(args, name, value)
    steps = set(args.steps.split(","))
    rep = max(1, args.repeat)
    work = args.work or Path(tempfile.mkdtemp(prefix="hsq-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    srv = RedisServer(work / "redis").wait_ready()
    try:
        url = srv.url
        client = connect(url)
        ds, out = args.dataset or work / "data.jsonl", work / "out"
        n = args.samples
        if not ds.exists() or ("gen" in steps and args.dataset is None):
            wall, size = timed(lambda: write_dataset(ds, n, args.min_tokens, args.max_tokens))
            report(
                "gen", samples=n, bytes=size, bytes_per_line=round(size / n), wall_s=round(wall, 1)
            )
        enq = ["enqueue", str(ds), "--run", RUN, "--out", str(out), "--redis", url]
        enq += ["--no-progress"] + (["--chunk-size", str(args.chunk)] if args.chunk else [])
        time_enqueue(client, enq, n, args.chunk, steps, rep)
        if "status" in steps:
            report("status_all_queued", **status_time(url, repeat=rep))
            wall, _ = timed(lambda: run_progress(url, n))
            mem1 = used_memory(client)
            report(
                "mid_run_state",
                wall_s=round(wall, 1),
                redis_bytes_per_sample_overall=round(mem1 / n, 1),
                note="half done, 1% dead, 64 jobs held",
                used_memory=mem1,
            )
            report("status_mid_run", **status_time(url, repeat=rep))
            report("status_recount", **status_time(url, "--recount"))
        if "requeue" in steps:
            wall, proc = timed(lambda: hsq("requeue", "--run", RUN, "--failed", "--redis", url))
            report("requeue_failed", wall_s=round(wall, 1), output=proc.stdout.strip())
            report("status_after_requeue", **status_time(url, repeat=rep))
        if "verify" in steps and args.verify_files:
            verify_step(args, client, work, out, url, rep)
        if "recover" in steps and args.recover_files:
            rrun = "scale-recover"
            rds, rout = make_outputs(work, rrun, args.recover_files, url)
            hsq("purge", "--run", rrun, "--yes", "--redis", url)
            rec = ("recover", str(rds), "--run", rrun, "--out", str(rout), "--redis", url)
            wall, proc = timed(lambda: hsq(*rec, "--no-progress"))
            recovered = [x for x in proc.stdout.splitlines() if x.startswith("recovered")]
            report(
                "recover",
                files=args.recover_files,
                wall_s=round(wall, 1),
                files_per_s=round(args.recover_files / wall),
                output=recovered[0] if recovered else proc.stdout[-300:],
            )
        if "capacity" in steps:
            rows = []
            for chunk in (int(c) for c in args.cap_chunks.split(",")):
                for mode in ("--per-sample", f"--batch={chunk}"):
                    cmd = [sys.executable, "-m", "bench.redis_capacity", "--samples",
                           str(args.cap_samples), "--chunk", str(chunk), "--procs",
                           str(args.cap_procs), mode]  # fmt: skip
                    out_ = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                    rows.append(json.loads(out_.strip().splitlines()[-1]))
            report("capacity", rows=rows)
    finally:
        srv.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"summary": results}, indent=1))
    print_targets()


PRESETS: dict[str, dict[str, Any]] = {
    # The target sizes: a 10M-line enqueue and a verify of 1M outputs (~1 h, ~8 GB disk).
    "10m": {"samples": 10_000_000, "chunk": 64, "verify_files": 1_000_000, "recover_files": 500,
            "steps": "gen,enqueue,reenqueue,status,verify"},
    # `make bench`: the same steps at a size a CI machine affords in minutes.
    "ci": {"samples": 200_000, "chunk": 64, "verify_files": 20_000, "recover_files": 100,
           "steps": "gen,enqueue,reenqueue,status,verify"},
}  # fmt: skip
TARGETS = (
    # (step, what, the target's size, seconds at that size, the size this run measured)
    ("enqueue", "`hsq enqueue` of 10M lines", 10_000_000, 60.0, "samples"),
    ("verify_headers", "`hsq verify` of 1M outputs", 1_000_000, 60.0, "files"),
    ("verify_headers_cold", "`hsq verify` of 1M outputs, pages dropped", 1_000_000, 60.0, "files"),
)


def print_targets() -> None:
    """Each target beside this run's figures (best wall time, CPU time of every run)."""
    print("\ntarget | size here | wall (best) | CPU per run | projected to target size | met")
    for step, what, size, limit, field in TARGETS:
        row = results.get(step)
        if not row or not row.get(field):
            continue
        here = row[field]
        proj = row["wall_s"] * size / here
        cpus = ", ".join(f"{r['cpu_s']} s" for r in row["runs"])
        verdict = "yes" if proj <= limit else "no"
        print(f"{what} <= {limit:.0f} s | {here:,} | {row['wall_s']} s | {cpus} | "
              f"{proj:.1f} s | {verdict}")  # fmt: skip
    for step in ("status_all_queued", "status_mid_run", "status_after_requeue"):
        row = results.get(step)
        if row and "wall_s" in row:
            cpus = ", ".join(f"{r['cpu_s']} s" for r in row["runs"])
            verdict = "yes" if row["wall_s"] <= 1.0 else "no"
            print(f"`hsq status` ({step}) <= 1 s | {row['total']:,} samples | "
                  f"{row['wall_s']} s | {cpus} | - | {verdict}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
