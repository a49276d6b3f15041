"""Train while extracting, its speed: is the stream ever the limit?

On a real redis-server, with the null-model server (bench/ceiling.py's setup: a worker at
its own ceiling, no model cost, the 8B shape) and with `hsq run` itself:

  worker      one `hsq worker`'s own rate, an offline run (bench.ceiling.run_case): the
              baseline, measured in the same invocation
  delivery    a streamed run extracted in full first (a full spool), then read through
              StreamingHiddenStateDataset by one consumer in this process and by a
              StreamingDataLoader with --loader-workers processes (each a group of its
              own, so each reads every sample); the reader touches every page of every
              tensor (as a copy to the GPU would): items/s (whole pass, and steady: after
              the first item) and GB/s against the worker's samples/s (target >= 10x), and
              the readers' CPU per item against the worker's CPU per sample (a ratio that
              holds on a loaded machine, where wall-clock rates do not)
  worker_keeps_up  the null-server worker streamed, a trainer thread here reading as it
              extracts (budget 64 samples, a commit every 16): its samples/s over the
              offline one
  hsq_run     `hsq run DATASET --engine reference` (the real command as a process: its own
              redis-server, the reference server with the tiny model on CPU, a worker),
              once without a stream and once with --spool-budget and a trainer thread here
              that keeps up (a commit every 16 items): the extraction rates (the workers'
              sample_done window) and their ratio (target >= 0.97), the trainer's data-wait
              share (near 1: it waits for extraction, it is not the limit)
  redis       commands per sample (INFO commandstats, Lua's inner calls counted): the
              streamed worker's less the offline worker's (reservation + publish), and a
              reader's per item (read, done-mark check, commit, removal)

    .venv/bin/python -m bench.stream                 # make bench (this 2-core machine)
    .venv/bin/python -m bench.stream --smoke         # make bench-smoke: seconds, no figures
    python3 -m bench.stream --preset host --json stream.json   # a 16-core host (< 4 min)

Prints one JSON line per measure and a summary with the targets; --json writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.ceiling import WORKLOADS, Case, run_case
from bench.stream_run import Trainer, extraction_rate, hsq_run, touch_item
from hsq.data import StreamingDataLoader, StreamingHiddenStateDataset
from hsq.node.procs import RedisServer, hsq_command
from hsq.producer.enqueue import enqueue_run
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect, redis_calls
from tests.support.nullserver import SHAPES
from tests.support.procs import NullServer

TARGET_DELIVERY_X = 10.0
TARGET_KEEPS_UP = 0.97
PRESETS: dict[str, dict[str, Any]] = {
    # This 2-core machine (make bench): seconds of steady state at its rates.
    "cpu": {"samples": 200, "run_samples": 300, "run_pairs": 2},
    # A 16-core host: the worker as in BENCHMARKS.md's ceiling table (K 32, 8 persist
    # processes: ~460 short samples/s on the H200 machine), seconds of steady state,
    # outputs on tmpfs (~15 GB at a time), the whole run under 4 minutes.
    "host": {
        "samples": 2000,
        "run_samples": 1000,
        "run_pairs": 2,
        "inflight": 32,
        "persist_procs": 8,
    },
    "smoke": {"samples": 12, "run_samples": 12, "shape": "tiny"},
}


def streamed_run(
    redis_url: str, work: Path, n: int, workload: str, budget: int, groups: list[str]
) -> tuple[RunStore, Path]:
    lo, hi = WORKLOADS[workload]
    run = f"stream-{secrets.token_hex(3)}"
    ds = work / f"{run}.jsonl"
    write_synthetic(ds, n, seed=11, min_len=lo, max_len=hi, vocab=32000)
    store = RunStore(connect(redis_url), run)
    cfg = RunConfig(
        run=run, dataset=str(ds), out=str(work / "out"), spool_budget=budget, consumers=groups
    )
    enqueue_run(store, cfg, progress=False)
    return store, work / "out" / run


def start_worker(
    store: RunStore, server: NullServer, redis_url: str, log: Path, inflight: int, procs: int
) -> subprocess.Popen[bytes]:
    argv = hsq_command(
        "worker", "--run", store.run, "--server", server.url, "--dump-dir",
        str(server.dump_dir), "--redis", redis_url, "--burst", "--inflight", str(inflight),
        "--persist-procs", str(procs),
    )  # fmt: skip
    with open(log, "wb") as f:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)


def wait_published(store: RunStore, n: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    while store.spool.published() < n:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.02)


def sum_bytes(item: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in item.values() if isinstance(v, torch.Tensor))


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@dataclass
class Reading:
    items: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    first_s: float = 0.0
    """Seconds to the first item (DataLoader worker processes starting, first reads)."""
    steady_s: float = 0.0
    """Seconds from the first item to the last."""
    cpu_s: float = 0.0
    """This process's CPU and its DataLoader workers' (reaped when the pass ends)."""

    def to_dict(self) -> dict[str, Any]:
        steady = (self.items - 1) / self.steady_s if self.steady_s > 0 else None
        return {
            "items": self.items,
            "seconds": round(self.seconds, 3),
            "first_item_s": round(self.first_s, 3),
            "items_s": round(self.items / self.seconds, 1),
            "steady_items_s": None if steady is None else round(steady, 1),
            "gb_s": round(self.nbytes / self.seconds / 1e9, 3),
            "steady_gb_s": (
                None if steady is None else round(self.nbytes / self.items * steady / 1e9, 3)
            ),
            "cpu_ms_per_item": round(self.cpu_s * 1e3 / max(self.items, 1), 3),
        }


def read_all(ds: StreamingHiddenStateDataset, workers: int, touched: bool) -> Reading:
    """One pass over the group, every page of every tensor touched or none."""
    loader: Any = StreamingDataLoader(ds, batch_size=None, num_workers=workers) if workers else ds
    r = Reading()
    c0 = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    t_first = t_last = t0
    for item in loader:
        t_last = time.perf_counter()
        if not r.items:
            t_first = t_last
        r.items += 1
        r.nbytes += touch_item(item) if touched else sum_bytes(item)
    del loader  # a DataLoader's workers are reaped once it ends: their CPU is counted
    r.seconds = time.perf_counter() - t0
    r.first_s, r.steady_s = t_first - t0, t_last - t_first
    r.cpu_s = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN) - c0
    return r


def delivery(
    server: NullServer, redis_url: str, work: Path, a: argparse.Namespace
) -> dict[str, Any]:
    lw = a.loader_workers
    readers = {  # group -> (DataLoader workers, pages touched), each a key of the result
        "one_consumer": (0, True),
        f"loader_{lw}_workers": (lw, True),
        "one_consumer_untouched": (0, False),
        f"loader_{lw}_workers_untouched": (lw, False),
    }
    groups = [g.replace("_", "-") for g in readers]
    store, _ = streamed_run(redis_url, work, a.samples, a.workload, 1 << 40, groups)
    client = store.client
    log = work / f"{store.run}.log"
    c0 = redis_calls(client)
    proc = start_worker(store, server, redis_url, log, a.inflight, a.persist_procs)
    wait_published(store, a.samples, proc, log)
    worker_cmds = redis_calls(client) - c0 - 1
    # The worker keeps beating while it waits for the commits: its calls are counted up to
    # the last publish only (heartbeats included, as in the offline run's figure).
    out: dict[str, Any] = {
        "samples": a.samples,
        "streamed_worker_redis_cmds_per_sample": round(worker_cmds / a.samples, 2),
    }
    for (key, (workers, touched)), group in zip(readers.items(), groups, strict=True):
        ds = StreamingHiddenStateDataset(store.run, redis_url=redis_url, group=group)
        c0 = redis_calls(client)
        r = read_all(ds, workers, touched)
        c1 = redis_calls(client)
        ds.commit(ds.state_dict())  # the last group's removes the files
        c2 = redis_calls(client)
        out[key] = {
            **r.to_dict(),
            "redis_cmds_per_item_read": round((c1 - c0 - 1) / max(r.items, 1), 2),
            "redis_cmds_per_item_commit": round((c2 - c1 - 1) / max(r.items, 1), 2),
        }
    proc.wait(120)
    return out


def worker_keeps_up(
    server: NullServer, redis_url: str, work: Path, a: argparse.Namespace
) -> dict[str, Any]:
    lo, hi = WORKLOADS[a.workload]
    hidden = SHAPES[a.shape][0]
    per_sample = (lo + hi) // 2 * hidden * 4 * 2  # 3 aux + 1 last, bf16
    store, _ = streamed_run(redis_url, work, a.samples, a.workload, 64 * per_sample, ["train"])
    log = work / f"{store.run}.log"
    ds = StreamingHiddenStateDataset(store.run, redis_url=redis_url, poll_s=0.05)
    trainer = Trainer(ds)
    proc = start_worker(store, server, redis_url, log, a.inflight, a.persist_procs)
    proc.wait(3600)
    trainer.join()
    rate = extraction_rate([log])
    return {"samples": a.samples, "budget_bytes": 64 * per_sample, **rate, **trainer.stats()}


def work_root(want: str | None, need_bytes: int) -> str | None:
    """tmpfs when it has room for the outputs of one phase (what the worker's own rate is
    measured on), else the default temporary directory."""
    if want:
        return want
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need_bytes * 1.5:
        return str(shm)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--samples", type=int, default=None, help="null-server runs' samples")
    ap.add_argument("--run-samples", type=int, default=None, help="each `hsq run`'s samples")
    ap.add_argument("--workload", default="short", choices=sorted(WORKLOADS))
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--inflight", type=int, default=None, help="the workers' (default 16)")
    ap.add_argument("--persist-procs", type=int, default=None, help="the workers' (default 0)")
    ap.add_argument("--loader-workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=1, help="`hsq run`'s reference servers")
    ap.add_argument("--run-pairs", type=int, default=None, help="`hsq run` pairs (default 1)")
    ap.add_argument("--work-dir", default=None, help="default: /dev/shm when it has room")
    ap.add_argument("--smoke", action="store_true", help="= --preset smoke (make bench-smoke)")
    ap.add_argument("--json", "--json-out", dest="json", type=Path, default=None)
    a = ap.parse_args()
    preset = PRESETS["smoke" if a.smoke else a.preset]
    a.samples = a.samples or preset["samples"]
    a.run_samples = a.run_samples or preset["run_samples"]
    a.shape = preset.get("shape", a.shape)
    a.run_pairs = a.run_pairs or preset.get("run_pairs", 1)
    a.inflight = a.inflight or preset.get("inflight", 16)
    a.persist_procs = (
        a.persist_procs if a.persist_procs is not None else preset.get("persist_procs", 0)
    )
    lo, hi = WORKLOADS[a.workload]
    need = a.samples * (lo + hi) // 2 * SHAPES[a.shape][0] * 8
    t_start = time.monotonic()
    results: dict[str, Any] = {
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(a).items()},
    }
    with tempfile.TemporaryDirectory(
        prefix="hsq-bench-stream-", dir=work_root(a.work_dir, need)
    ) as tmp:
        work = Path(tmp)
        redis = RedisServer(work / "redis", password=secrets.token_hex(8)).wait_ready()
        server = NullServer(
            work / "dumps", work / "server.log",
            args=["--shape", a.shape, "--max-tokens", str(hi)],
        )  # fmt: skip
        try:
            server.wait_ready(timeout=300)
            case = Case(a.shape, a.workload, "bf16", a.samples, a.inflight, a.persist_procs)
            base = run_case(case, server, redis.url, work, work / "out", [])
            results["worker"] = base
            print(json.dumps({"worker": base}), flush=True)
            results["delivery"] = delivery(server, redis.url, work, a)
            print(json.dumps({"delivery": results["delivery"]}), flush=True)
            results["worker_keeps_up"] = worker_keeps_up(server, redis.url, work, a)
            print(json.dumps({"worker_keeps_up": results["worker_keeps_up"]}), flush=True)
        finally:
            server.stop()
            redis.stop()
        results["hsq_run"] = hsq_run(work, a)
    results["summary"] = summarize(results, a)
    results["seconds"] = round(time.monotonic() - t_start, 1)
    print(json.dumps({"summary": results["summary"]}, indent=1), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(results, indent=1))


def summarize(r: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    w = float(r["worker"]["samples_s"])
    w_cpu = float(r["worker"]["cpu_ms_per_sample"])
    d = r["delivery"]
    lw = a.loader_workers
    one, loader = d["one_consumer"], d[f"loader_{lw}_workers"]
    one_u, loader_u = d["one_consumer_untouched"], d[f"loader_{lw}_workers_untouched"]

    def x(v: float | None) -> float | None:
        return None if v is None else round(v / w, 1)

    keeps = r["hsq_run"]
    return {
        "worker_samples_s": w,
        "worker_gb_s": r["worker"]["gb_s"],
        "delivery_one_consumer_x": x(one["items_s"]),
        "delivery_one_consumer_steady_x": x(one["steady_items_s"]),
        f"delivery_loader_{lw}_workers_x": x(loader["items_s"]),
        f"delivery_loader_{lw}_workers_steady_x": x(loader["steady_items_s"]),
        # The same without touching the tensors: what the stream costs beyond the page
        # faults a trainer pays on any mapped dataset (HiddenStateDataset's too).
        "delivery_one_consumer_untouched_x": x(one_u["items_s"]),
        f"delivery_loader_{lw}_workers_untouched_steady_x": x(loader_u["steady_items_s"]),
        "target_delivery_x": TARGET_DELIVERY_X,
        # CPU a sample costs the worker over CPU an item costs its readers: holds on a
        # loaded machine, where the wall-clock ratios above swing with the other jobs.
        "cpu_ratio_one_consumer": round(w_cpu / one["cpu_ms_per_item"], 1),
        f"cpu_ratio_loader_{lw}_workers": round(w_cpu / loader["cpu_ms_per_item"], 1),
        "worker_keeps_up_ratio": round(r["worker_keeps_up"]["samples_s"] / w, 3),
        "hsq_run_keeps_up_ratio": keeps["ratio"],
        "hsq_run_keeps_up_steady_ratio": keeps["steady_ratio"],
        "hsq_run_pair_ratios": keeps["pair_ratios"],
        "hsq_run_trainer_data_wait_share": keeps["trainer_data_wait_share"],
        "target_keeps_up": TARGET_KEEPS_UP,
        "reserve_publish_redis_cmds_per_sample": round(
            d["streamed_worker_redis_cmds_per_sample"] - r["worker"]["redis_cmds_per_sample"], 2
        ),
        "offline_worker_redis_cmds_per_sample": r["worker"]["redis_cmds_per_sample"],
        "one_consumer_redis_cmds_per_item_read": one["redis_cmds_per_item_read"],
        "loader_redis_cmds_per_item_read": loader["redis_cmds_per_item_read"],
        # Commit (ack, count) and, by the last group to commit, removal (release, record).
        "redis_cmds_per_item_commit_and_removal": d[f"loader_{lw}_workers_untouched"][
            "redis_cmds_per_item_commit"
        ],
    }


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    main()
