"""bench.stream's `hsq run` case: the real command as a process (its own redis-server, the
reference server with the tiny model on CPU, a worker), without a stream and with
--spool-budget and a trainer thread that keeps up; the extraction rates from the workers'
sample_done windows, their ratio, and the trainer's data-wait share.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.ceiling import WORKLOADS, _events, _ts
from hsq.data import StreamingHiddenStateDataset
from hsq.node.procs import hsq_command
from hsq.producer.synthetic import write_synthetic
from hsq.runstore import RunStore
from hsq.store import connect

COMMIT_EVERY = 16
"""The trainers' checkpoint-and-commit interval, in items."""


def touch(t: torch.Tensor) -> int:
    """Read one byte of every page of the tensor (a mapped file's pages are faulted in, as
    a trainer's copy to the GPU would): delivered means in this process's memory, not
    merely mapped. Its bytes."""
    flat = t.reshape(-1).view(torch.uint8)
    int(flat[::4096].sum())
    return flat.numel()


def touch_item(item: dict[str, Any]) -> int:
    return sum(touch(v) for v in item.values() if isinstance(v, torch.Tensor) and v.numel())


class Trainer:
    """A trainer that keeps up, in a thread here: every page of every item touched, a
    commit every COMMIT_EVERY items (its checkpoint costs nothing) and at the end."""

    def __init__(self, ds: StreamingHiddenStateDataset | None = None, **open_kw: Any) -> None:
        self.ds = ds
        self.open_kw = open_kw
        self.items = 0
        self.cpu_s = 0.0
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._main, daemon=True)
        self._t.start()

    def _main(self) -> None:
        try:
            ds = self.ds if self.ds is not None else self._wait_for_run()
            self.ds = ds
            c0 = time.thread_time()
            for item in ds:
                touch_item(item)
                self.items += 1
                if self.items % COMMIT_EVERY == 0:
                    ds.commit(ds.state_dict())
            ds.commit(ds.state_dict())
            self.cpu_s = time.thread_time() - c0
        except BaseException as exc:  # reported by join()
            self.error = exc

    def _wait_for_run(self) -> StreamingHiddenStateDataset:
        """`hsq run` writes its Redis URL file, then enqueues: wait for both."""
        kw = dict(self.open_kw)
        url_file: Path = kw.pop("redis_url_file")
        deadline = time.monotonic() + 300
        while True:
            try:
                if url_file.exists():
                    url = url_file.read_text().strip()
                    if RunStore(connect(url), kw["run"]).load_config() is not None:
                        return StreamingHiddenStateDataset(redis_url=url, **kw)
            except Exception:  # Redis starting, the run not enqueued yet
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"no run {kw['run']!r} behind {url_file}")
            time.sleep(0.05)

    def join(self, timeout: float = 300) -> None:
        self._t.join(timeout)
        if self._t.is_alive():
            raise RuntimeError("the trainer thread did not end")
        if self.error is not None:
            raise self.error

    def stats(self) -> dict[str, Any]:
        wait = self.ds.wait_stats() if self.ds is not None else {}
        return {
            "trained": self.items,
            "trainer_data_wait_share": wait.get("wait_share"),
            "trainer_cpu_ms_per_item": round(self.cpu_s * 1e3 / max(self.items, 1), 3),
        }


def extraction_rate(logs: list[Path]) -> dict[str, Any]:
    """samples/s and tokens/s between the first and the last `sample_done` of the logs, and
    steady: from the tenth's done on (a streamed run's first sample goes alone: its size is
    known once its dump pinned the model's shape, so it reserves the whole budget; the
    pipeline fills after it, once per run)."""
    events = [e for log in logs for e in _events(log)]
    done = [e for e in events if e.get("event") == "sample_done"]
    cpu = sum(float(e.get("cpu_s") or 0) for e in events if e.get("event") == "worker_stopped")
    if len(done) < 2:
        raise RuntimeError(f"{len(done)} samples done in {[str(p) for p in logs]}")
    stamps = sorted(_ts(e["timestamp"]) for e in done)
    window = max(stamps[-1] - stamps[0], 1e-9)
    tokens = sum(int(e["tokens"]) for e in done)
    k = len(done) // 10
    steady = (len(done) - 1 - k) / max(stamps[-1] - stamps[k], 1e-9)
    return {
        "done": len(done),
        "window_s": round(window, 3),
        "samples_s": round((len(done) - 1) / window, 2),
        "steady_samples_s": round(steady, 2),
        "tok_s": round(tokens * (len(done) - 1) / len(done) / window, 1),
        "bytes_per_sample": round(sum(int(e["bytes"]) for e in done) / len(done)),
        "worker_own_cpu_ms_per_sample": round(cpu * 1e3 / len(done), 2),
    }


def hsq_run_case(work: Path, a: argparse.Namespace, budget: int | None) -> dict[str, Any]:
    """One `hsq run` of a fresh copy of the dataset, streamed (with a trainer) or not."""
    lo, hi = WORKLOADS[a.workload]
    tag = "streamed" if budget else "offline"
    run = f"hr-{tag}-{secrets.token_hex(2)}"
    ds = work / f"{run}.jsonl"
    write_synthetic(ds, a.run_samples, seed=11, min_len=lo, max_len=hi, vocab=32000)
    out = work / run
    argv = hsq_command(
        "run", str(ds), "--out", str(out), "--run", run, "--engine", "reference",
        "--servers", str(a.servers), "--json", "--max-tokens", str(hi),
    )  # fmt: skip
    if budget:
        argv += ["--spool-budget", str(budget)]
    # The tiny model runs on the CPU: half the cores for its torch threads, the rest for
    # the worker, Redis and the trainer (an oversubscribed thread pool would make the
    # trainer's CPU, not the stream, what the ratio shows).
    argv += ["--", "--threads", str(max(1, (os.cpu_count() or 2) // 2))]
    trainer = None
    if budget:
        trainer = Trainer(run=run, redis_url_file=out / ".hsq" / "redis-url", poll_s=0.05)
    log = work / f"{run}.log"
    t0 = time.monotonic()
    with open(log, "wb") as err:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, env=env, timeout=600)
    wall = time.monotonic() - t0
    if trainer is not None:
        trainer.join()
    lines = proc.stdout.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"hsq run exited {proc.returncode}: {log.read_text()[-3000:]}")
    summary = json.loads(lines[-1])
    rate = extraction_rate(sorted((out / ".hsq" / "logs").glob("worker-*.log")))
    row: dict[str, Any] = {
        "samples": a.run_samples,
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "hsq_run_samples_s": summary["status"].get("samples_per_s"),
        "starting_s": summary.get("starting_s"),
        "stream": summary.get("stream"),
        **rate,
    }
    if budget:
        row["budget_bytes"] = budget
        row.update(trainer.stats() if trainer is not None else {})
    shutil.rmtree(out, ignore_errors=True)
    ds.unlink(missing_ok=True)
    return row


def hsq_run(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """--run-pairs pairs, each offline then streamed (a machine's drift falls on both)."""
    offline: list[dict[str, Any]] = []
    streamed: list[dict[str, Any]] = []
    for _ in range(a.run_pairs):
        offline.append(hsq_run_case(work, a, None))
        print(json.dumps({"hsq_run_offline": offline[-1]}), flush=True)
        budget = 64 * int(offline[0]["bytes_per_sample"])  # a checkpoint interval's, x4
        streamed.append(hsq_run_case(work, a, budget))
        print(json.dumps({"hsq_run_streamed": streamed[-1]}), flush=True)

    def ratio(key: str) -> float:
        return round(sum(float(r[key]) for r in streamed) / sum(float(r[key]) for r in offline), 3)

    return {
        "offline": offline,
        "streamed": streamed,
        "ratio": ratio("samples_s"),
        "steady_ratio": ratio("steady_samples_s"),
        "pair_ratios": [
            round(s["samples_s"] / o["samples_s"], 3)
            for o, s in zip(offline, streamed, strict=True)
        ],
        "trainer_data_wait_share": [r.get("trainer_data_wait_share") for r in streamed],
    }
