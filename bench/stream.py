"""Train while extracting, its speed: is the stream ever the limit?

Against one real `hsq worker` and the null-model server (bench/ceiling.py's setup: the
worker at its own ceiling, no model cost) on a real redis-server:

  worker      the worker's own rate, an offline run (bench.ceiling.run_case): the baseline
  delivery    a streamed run extracted in full first (a full spool), then read through
              StreamingHiddenStateDataset: one consumer in this process, and a
              StreamingDataLoader with 4 worker processes (each a new group, so each reads
              every sample): items/s and GB/s, and their ratio to the worker's samples/s
              (target >= 10x)
  keeps-up    a streamed run whose trainer (a thread here, num_workers=0, a commit every
              16 items) reads as the worker extracts, its budget 64 samples: the worker's
              samples/s over the offline one (target >= 0.97)
  redis       commands per sample (INFO commandstats): the streamed worker's less the
              offline worker's (reservation + publish), and a consumer's per item
              (read, done-mark check, commit, removal)

    .venv/bin/python -m bench.stream            # make bench
    .venv/bin/python -m bench.stream --smoke    # make bench-smoke: seconds, no figures asserted

Prints one JSON line per measure and a summary with the targets.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.ceiling import WORKLOADS, Case, run_case
from hsq.data import StreamingDataLoader, StreamingHiddenStateDataset
from hsq.node.procs import RedisServer, hsq_command
from hsq.producer.enqueue import enqueue_run
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect, redis_calls
from tests.support.procs import NullServer

TARGET_DELIVERY_X = 10.0
TARGET_KEEPS_UP = 0.97


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
    store: RunStore, server: NullServer, redis_url: str, log: Path, inflight: int
) -> subprocess.Popen[bytes]:
    argv = hsq_command(
        "worker", "--run", store.run, "--server", server.url, "--dump-dir",
        str(server.dump_dir), "--redis", redis_url, "--burst", "--inflight", str(inflight),
    )  # fmt: skip
    with open(log, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)


def wait_published(store: RunStore, n: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    while store.spool.published() < n:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.02)


def read_all(ds: StreamingHiddenStateDataset, workers: int) -> tuple[int, int, float]:
    """(items, bytes of their tensors, seconds) for one pass over the group."""
    loader: Any = StreamingDataLoader(ds, batch_size=None, num_workers=workers) if workers else ds
    items = nbytes = 0
    t0 = time.perf_counter()
    for item in loader:
        items += 1
        for v in item.values():
            if isinstance(v, torch.Tensor) and v.numel():
                nbytes += touch(v)
    return items, nbytes, time.perf_counter() - t0


def touch(t: torch.Tensor) -> int:
    """Read one byte of every page of the tensor (a mapped file's pages are faulted in, as
    a trainer's copy to the GPU would): delivered means in this process's memory, not
    merely mapped. Its bytes."""
    flat = t.reshape(-1).view(torch.uint8)
    int(flat[::4096].sum())
    return flat.numel()


def delivery(
    server: NullServer, redis_url: str, work: Path, n: int, workload: str, inflight: int
) -> dict[str, Any]:
    groups = ["one", "four"]
    store, _ = streamed_run(redis_url, work, n, workload, 1 << 40, groups)
    client = store.client
    log = work / f"{store.run}.log"
    c0 = redis_calls(client)
    proc = start_worker(store, server, redis_url, log, inflight)
    wait_published(store, n, proc, log)
    worker_cmds = redis_calls(client) - c0 - 1
    out: dict[str, Any] = {"samples": n, "streamed_worker_redis_cmds_per_sample": None}
    # The worker keeps beating while it waits for the commits: its calls are counted up to
    # the last publish only (heartbeats included, as in the offline run's figure).
    out["streamed_worker_redis_cmds_per_sample"] = round(worker_cmds / n, 2)
    for group, workers in (("one", 0), ("four", 4)):
        ds = StreamingHiddenStateDataset(store.run, redis_url=redis_url, group=group)
        c0 = redis_calls(client)
        items, nbytes, secs = read_all(ds, workers)
        cmds = redis_calls(client) - c0 - 1
        ds.commit(ds.state_dict())
        out[f"{group}_consumer" if workers == 0 else "four_dataloader_workers"] = {
            "items": items,
            "items_s": round(items / secs, 1),
            "gb_s": round(nbytes / secs / 1e9, 3),
            "redis_cmds_per_item": round(cmds / max(items, 1), 2),
        }
    proc.wait(120)
    return out


def keeps_up(
    server: NullServer, redis_url: str, work: Path, n: int, workload: str, inflight: int
) -> dict[str, Any]:
    lo, hi = WORKLOADS[workload]
    per_sample = (lo + hi) // 2 * 4096 * 4 * 2  # the 8b shape: 3 aux + 1 last, bf16
    store, _ = streamed_run(redis_url, work, n, workload, 64 * per_sample, ["train"])
    log = work / f"{store.run}.log"
    got: list[int] = []
    ds = StreamingHiddenStateDataset(store.run, redis_url=redis_url, poll_s=0.05)

    def trainer() -> None:
        for i, _item in enumerate(ds, 1):
            got.append(i)
            if i % 16 == 0:
                ds.commit(ds.state_dict())
        ds.commit(ds.state_dict())

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    proc = start_worker(store, server, redis_url, log, inflight)
    proc.wait(3600)
    t.join(120)
    done = [json.loads(x) for x in log.read_text().splitlines() if '"sample_done"' in x]
    stamps = sorted(time.mktime(time.strptime(e["timestamp"][:19], "%Y-%m-%dT%H:%M:%S"))
                    + float("0." + e["timestamp"][20:26]) for e in done)  # fmt: skip
    window = max(stamps[-1] - stamps[0], 1e-9)
    return {
        "samples": n,
        "trained": len(got),
        "samples_s": round((len(done) - 1) / window, 2),
        "trainer_data_wait_share": ds.wait_stats()["wait_share"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=120)
    ap.add_argument("--workload", default="short", choices=sorted(WORKLOADS))
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny shape, 12 samples")
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()
    if a.smoke:
        a.samples, a.shape = 12, "tiny"
    with tempfile.TemporaryDirectory(prefix="hsq-bench-stream-", dir="/dev/shm") as tmp:
        work = Path(tmp)
        redis = RedisServer(work / "redis", password=secrets.token_hex(8)).wait_ready()
        hi = WORKLOADS[a.workload][1]
        server = NullServer(
            work / "dumps", work / "server.log",
            args=["--shape", a.shape, "--max-tokens", str(hi)],
        )  # fmt: skip
        try:
            server.wait_ready(timeout=300)
            case = Case(a.shape, a.workload, "bf16", a.samples, a.inflight)
            base = run_case(case, server, redis.url, work, work / "out", [])
            print(json.dumps({"worker": base}), flush=True)
            deliv = delivery(server, redis.url, work, a.samples, a.workload, a.inflight)
            print(json.dumps({"delivery": deliv}), flush=True)
            up = keeps_up(server, redis.url, work, a.samples, a.workload, a.inflight)
            print(json.dumps({"keeps_up": up}), flush=True)
        finally:
            server.stop()
            redis.stop()
    w = float(base["samples_s"])
    summary = {
        "machine": "this one (see BENCHMARKS.md for which)",
        "worker_samples_s": w,
        "delivery_one_consumer_x": round(deliv["one_consumer"]["items_s"] / w, 1),
        "delivery_four_workers_x": round(deliv["four_dataloader_workers"]["items_s"] / w, 1),
        "target_delivery_x": TARGET_DELIVERY_X,
        "keeps_up_ratio": round(up["samples_s"] / w, 3),
        "target_keeps_up": TARGET_KEEPS_UP,
        "reserve_publish_redis_cmds_per_sample": round(
            deliv["streamed_worker_redis_cmds_per_sample"] - base["redis_cmds_per_sample"], 2
        ),
        "offline_worker_redis_cmds_per_sample": base["redis_cmds_per_sample"],
    }
    print(json.dumps({"summary": summary}, indent=1), flush=True)
    if a.json_out is not None:
        a.json_out.write_text(json.dumps({"worker": base, "delivery": deliv, "keeps_up": up,
                                          "summary": summary}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
