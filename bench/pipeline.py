"""hsq against the bare server and the straightforward way, side by side in one run.

For the same reference server and the same samples, in one process tree:
  bare   a tight loop: clear the dump dir, POST /generate, wait for the dump, delete it
         (no queue, no validation of tensors, no persistence): what the server can do.
  naive  one sample at a time: send, wait, load and check the tensors, save the output with
         safetensors and fsync, then the next.
  hsq    the product: producer, Redis, one `hsq worker` (persist stage overlapping the next
         prefill), durable files, done keys.
  storage bound  durable write bandwidth of the output disk / output bytes per token.

    .venv/bin/python bench/pipeline.py                               # CPU, tiny model
    python bench/pipeline.py --model llama-8b --device cuda --dump-root /dev/shm ...

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from hsq.dataset import read_sample, scan_dataset
from hsq.demo import redis_calls
from hsq.procs import RedisServer, ReferenceServer, worker_process
from hsq.protocol import Expected, clear_dump_dir, fingerprint, read_dump, wait_for_dump
from hsq.runconfig import RunConfig
from hsq.store import RunStore, connect
from hsq.synthetic import write_synthetic
from producer.enqueue import enqueue_run


def load_samples(ds: Path) -> list[tuple[str, list[int]]]:
    out = []
    for item in scan_dataset(ds):
        assert item.entry is not None and item.sample_id is not None
        out.append((item.sample_id, read_sample(ds, item.sample_id, item.entry).input_ids))
    return out


def post(client: httpx.Client, ids: list[int], rid: str) -> None:
    r = client.post(
        "/generate", json={"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
    )
    r.raise_for_status()


def bare(server: ReferenceServer, samples: list[tuple[str, list[int]]]) -> float:
    tokens = 0
    with httpx.Client(base_url=server.url, timeout=600) as client:
        t0 = time.perf_counter()
        for sid, ids in samples:
            clear_dump_dir(server.dump_dir)
            post(client, ids, f"bare-{sid}")
            wait_for_dump(server.dump_dir, 60)
            tokens += len(ids)
        elapsed = time.perf_counter() - t0
        clear_dump_dir(server.dump_dir)
    return tokens / elapsed


def naive(server: ReferenceServer, samples: list[tuple[str, list[int]]], out: Path) -> float:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tokens = 0
    with httpx.Client(base_url=server.url, timeout=600) as client:
        t0 = time.perf_counter()
        for sid, ids in samples:
            clear_dump_dir(server.dump_dir)
            rid = f"naive-{sid}-{secrets.token_hex(3)}"
            post(client, ids, rid)
            dump = read_dump(
                wait_for_dump(server.dump_dir, 60), Expected(rid, fingerprint(ids), len(ids))
            )
            path, tmp = out / f"{sid}.safetensors", out / f".{sid}.tmp"
            save_file(
                {
                    "input_ids": torch.tensor(ids),
                    "loss_mask": torch.ones(len(ids)),
                    "aux_hidden_states": dump.aux_hidden_states,
                    "last_hidden_state": dump.last_hidden_state,
                },
                str(tmp),
            )
            fd = os.open(tmp, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            os.rename(tmp, path)
            tokens += len(ids)
        elapsed = time.perf_counter() - t0
        clear_dump_dir(server.dump_dir)
    return tokens / elapsed


def hsq_run(
    server: ReferenceServer,
    redis_url: str,
    ds: Path,
    out: Path,
    run: str,
    work: Path,
    persist_threads: int,
) -> dict[str, Any]:
    client = connect(redis_url)
    store = RunStore(client, run)
    enqueue_run(store, RunConfig(run=run, dataset=str(ds), out=str(out)), progress=False)
    c0 = redis_calls(client)
    log = work / f"worker-{run}.log"
    w = worker_process(
        run,
        server.url,
        server.dump_dir,
        redis_url,
        log,
        "--burst",
        "--persist-threads",
        str(persist_threads),
    )
    rc = w.proc.wait(3600)
    calls = redis_calls(client) - c0 - 1
    done = store.count(store.k.done)
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    finished = [e for e in events if e.get("event") == "sample_done"]
    stopped = next(e for e in events if e.get("event") == "worker_stopped")
    ts = [
        time.mktime(time.strptime(e["timestamp"][:19], "%Y-%m-%dT%H:%M:%S"))
        + float("0." + e["timestamp"][20:26])
        for e in finished
    ]
    first = finished[ts.index(min(ts))]
    # The window: from the first sample's request start to the last sample's done.
    start = (
        min(ts)
        - (first["request_ms"] + first["wait_ms"] + first["stage_ms"] + first["persist_ms"]) / 1e3
    )
    elapsed = max(ts) - start
    tokens = sum(int(e["tokens"]) for e in finished)
    nbytes = sum(int(e["bytes"]) for e in finished)
    return {
        "rc": rc,
        "done": done,
        "tok_s": tokens / elapsed,
        "bytes_per_token": nbytes / tokens,
        "redis_cmds_per_sample": calls / max(done, 1),
        "worker_peak_rss_mb": stopped["peak_rss_mb"],
    }


def server_breakdown(log: Path) -> str:
    """Medians over the run of the server's own timings (where a request's time goes)."""
    vals: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        for key in ("e2e_ms", "forward_ms", "copy_wait_ms", "write_ms", "queued_ms"):
            if key in e:
                vals.setdefault(key, []).append(float(e[key]))
    return ", ".join(f"{k} {sorted(v)[len(v) // 2]:.1f}" for k, v in vals.items())


def disk_bandwidth(directory: Path, total_mb: int = 512, file_mb: int = 64) -> float:
    """Durable write bandwidth (bytes/s): files written and fsynced one after another."""
    directory.mkdir(parents=True, exist_ok=True)
    buf = os.urandom(file_mb * 2**20)
    t0 = time.perf_counter()
    for i in range(total_mb // file_mb):
        path = directory / f"bw{i}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(buf)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(directory)
    return total_mb * 2**20 / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=150)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="torch CPU threads of the server (leave a core for the client)",
    )
    ap.add_argument(
        "--dump-root",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="where dump dirs live (tmpfs, as in production)",
    )
    ap.add_argument("--out-root", default=None, help="output disk [default: a temp dir]")
    ap.add_argument("--persist-threads", type=int, default=2)
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hsq-bench-"))
    dump_root = Path(tempfile.mkdtemp(prefix="hsq-bench-dumps-", dir=args.dump_root))
    out_root = Path(tempfile.mkdtemp(prefix="hsq-bench-out-", dir=args.out_root))
    vocab = 128256 if args.model == "llama-8b" else 32000
    ds = work / "data.jsonl"
    write_synthetic(
        ds, args.samples, seed=7, min_len=args.min_len, max_len=args.max_len, vocab=vocab
    )
    samples = load_samples(ds)
    total_tokens = sum(len(ids) for _, ids in samples)
    redis_srv = RedisServer(work / "redis", password=secrets.token_hex(8)).wait_ready()
    server_args = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--warmup",
        "3",
        "--no-fsync",
        "--max-tokens",
        str(max(args.max_len, 8192)),
    ]
    if args.device == "cpu":
        server_args += ["--threads", str(args.server_threads)]
    server = ReferenceServer(
        dump_root / "d0", work / "server.log", args=server_args, env={"HSQ_LOG_LEVEL": "DEBUG"}
    )
    try:
        server.wait_ready(timeout=900)
        bare_tok_s = bare(server, samples)
        hsq_res = hsq_run(
            server, redis_srv.url, ds, out_root / "hsq", "bench", work, args.persist_threads
        )
        naive_tok_s = naive(server, samples, out_root / "naive")
        bare2 = bare(server, samples)  # bare again: the server's drift across the run
    finally:
        server.stop()
        redis_srv.stop()
    bw = disk_bandwidth(out_root / "bw")
    storage_tok_s = bw / hsq_res["bytes_per_token"]
    bare_tok_s = max(bare_tok_s, bare2)
    hsq_tok_s = hsq_res["tok_s"]
    bound = min(bare_tok_s, storage_tok_s)
    row = {
        "label": args.label or f"{args.model}/{args.device}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {os.cpu_count()} cpus",
        "samples": len(samples),
        "tokens": total_tokens,
        "bare_tok_s": round(bare_tok_s, 1),
        "hsq_tok_s": round(hsq_tok_s, 1),
        "naive_tok_s": round(naive_tok_s, 1),
        "storage_bound_tok_s": round(storage_tok_s, 1),
        "disk_write_gb_s": round(bw / 1e9, 3),
        "bytes_per_token": round(hsq_res["bytes_per_token"], 1),
        "efficiency": round(hsq_tok_s / bare_tok_s, 3),
        "efficiency_vs_bound": round(hsq_tok_s / bound, 3),
        "speedup_vs_naive": round(hsq_tok_s / naive_tok_s, 3),
        "redis_cmds_per_sample": round(hsq_res["redis_cmds_per_sample"], 2),
        "worker_peak_rss_mb": hsq_res["worker_peak_rss_mb"],
        "hsq_done": hsq_res["done"],
    }
    print(
        f"\nhsq benchmark: {row['label']}, {row['samples']} samples, {total_tokens} tokens "
        f"({args.min_len}-{args.max_len} per sample)"
    )
    lines = [
        ("bare server (clear-send-scan)", f"{row['bare_tok_s']:>12,.0f} tokens/s"),
        ("hsq (queue + worker + durable files)", f"{row['hsq_tok_s']:>12,.0f} tokens/s"),
        ("straightforward way (sequential)", f"{row['naive_tok_s']:>12,.0f} tokens/s"),
        (
            "storage bound (disk / bytes per token)",
            f"{row['storage_bound_tok_s']:>12,.0f} "
            f"tokens/s  ({row['disk_write_gb_s']} GB/s, {row['bytes_per_token']} B/token)",
        ),
        ("efficiency hsq / bare", f"{row['efficiency']:>12.3f}"),
        ("efficiency hsq / min(bare, storage)", f"{row['efficiency_vs_bound']:>12.3f}"),
        ("speedup hsq / straightforward", f"{row['speedup_vs_naive']:>12.3f}"),
        ("Redis commands per sample", f"{row['redis_cmds_per_sample']:>12.2f}"),
        ("worker peak RSS", f"{row['worker_peak_rss_mb']:>12.1f} MB"),
    ]
    for name, value in lines:
        print(f"  {name:<40} {value}")
    print("  server, median per request:", server_breakdown(work / "server.log"))
    shutil.rmtree(out_root, ignore_errors=True)
    shutil.rmtree(dump_root, ignore_errors=True)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
