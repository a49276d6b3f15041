"""hsq against the bare server and the straightforward way, side by side in one run.

For the same reference server and the same samples, in one process tree:
  bare   a tight loop: clear the dump dir, POST /generate, wait for the dump, delete it
         (no queue, no validation of tensors, no persistence): one request at a time.
  capacity  K clients keep K requests in flight on the batching server while a reaper
         deletes finished dumps (no validation, no persistence): what the server can do.
  naive  one sample at a time: send, wait, load and check the tensors, save the output with
         safetensors and fsync, then the next.
  hsq    the product: producer, Redis, one `hsq worker` (persist stage overlapping the next
         prefill), durable files, done keys.
  storage bound  the output disk's best durable write rate (bench/disk.py: several
         writers and O_DIRECT, not only one fsync'd stream) / output bytes per token.

    .venv/bin/python -m bench.pipeline                               # CPU, tiny model
    python -m bench.pipeline --model llama-8b --device cuda --dump-root /dev/shm ...
    python -m bench.pipeline --inflight 1,4,8,16     # hsq once per K, side by side

`--inflight K` is passed to `hsq worker` only when K != 1.

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.disk import probe
from hsq.dataset.jsonl import scan_dataset
from hsq.dataset.read import read_sample
from hsq.dump.find import clear_dump_dir, scan, wait_for_dump
from hsq.dump.format import fingerprint
from hsq.dump.read import Expected, read_dump
from hsq.node.procs import RedisServer, ReferenceServer, worker_process
from hsq.producer.enqueue import enqueue_run
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect, redis_calls


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


def capacity(server: ReferenceServer, samples: list[tuple[str, list[int]]], k: int) -> float:
    """Tokens/s with k requests in flight and finished dumps deleted as they appear: the
    batching server's throughput with no validation and no persistence."""
    clear_dump_dir(server.dump_dir)
    todo: queue.Queue[tuple[str, list[int]]] = queue.Queue()
    for item in samples:
        todo.put(item)
    errors: list[BaseException] = []

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            while True:
                try:
                    sid, ids = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    post(c, ids, f"cap-{sid}-{secrets.token_hex(3)}")
                except BaseException as exc:  # reported after the run
                    errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(k)]
    for t in threads:
        t.start()
    removed = 0
    deadline = time.monotonic() + 3600
    while removed < len(samples) and not errors and time.monotonic() < deadline:
        done = scan(server.dump_dir).complete
        for path in done:
            shutil.rmtree(path, ignore_errors=True)
        removed += len(done)
        if not done:
            time.sleep(0.002)
    elapsed = time.perf_counter() - t0
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"capacity run failed: {errors[0]!r}")
    clear_dump_dir(server.dump_dir)
    return sum(len(ids) for _, ids in samples) / elapsed


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
    inflight: int = 1,
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
        # The flag arrives with protocol v2 (branch worker12); K=1 runs on any worker.
        *(["--inflight", str(inflight)] if inflight != 1 else []),
    )
    rc = w.proc.wait(3600)
    calls = redis_calls(client) - c0 - 1
    done = store.count(store.keys.done)
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
        for key in ("e2e_ms", "forward_ms", "batch", "copy_wait_ms", "write_ms", "queued_ms"):
            if key in e:
                vals.setdefault(key, []).append(float(e[key]))
    return ", ".join(f"{k} {sorted(v)[len(v) // 2]:.1f}" for k, v in vals.items())


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
    ap.add_argument(
        "--inflight",
        default="1",
        help="comma list of K: one hsq run per K (`hsq worker --inflight K`), side by side",
    )
    ap.add_argument(
        "--capacity-inflight",
        type=int,
        default=16,
        help="requests in flight for the capacity figure",
    )
    ap.add_argument(
        "--max-batch-requests",
        type=int,
        default=None,
        help="server option [default: 16 on cuda, 1 on cpu: the server's own defaults' logic]",
    )
    ap.add_argument("--max-batch-tokens", type=int, default=16384)
    ap.add_argument(
        "--warmup-shapes",
        action="store_true",
        help="the server runs every padded batch shape once at start (CUDA)",
    )
    ap.add_argument("--disk-mb", type=int, default=1024, help="data per disk design")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    ks = [int(k) for k in args.inflight.split(",")]

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
        "--max-batch-requests",
        str(args.max_batch_requests or (1 if args.device == "cpu" else 16)),
        "--max-batch-tokens",
        str(args.max_batch_tokens),
    ]
    if args.device == "cpu":
        server_args += ["--threads", str(args.server_threads)]
    if args.warmup_shapes:
        server_args.append("--warmup-shapes")
    server = ReferenceServer(
        dump_root / "d0", work / "server.log", args=server_args, env={"HSQ_LOG_LEVEL": "DEBUG"}
    )
    hsq_res: dict[int, dict[str, Any]] = {}
    cap_at: dict[int, float] = {}
    try:
        server.wait_ready(timeout=900)
        capacity(server, samples[: min(len(samples), 2 * args.capacity_inflight)], 4)  # warm-up
        bare_tok_s = bare(server, samples)
        for k in sorted({*ks, args.capacity_inflight}):
            cap_at[k] = capacity(server, samples, k)
        for k in ks:
            hsq_res[k] = hsq_run(
                server,
                redis_srv.url,
                ds,
                out_root / f"hsq-k{k}",
                f"bench-k{k}",
                work,
                args.persist_threads,
                k,
            )
        naive_tok_s = naive(server, samples, out_root / "naive")
        bare2 = bare(server, samples)  # bare again: the server's drift across the run
    finally:
        server.stop()
        redis_srv.stop()
    disk = probe(out_root / "bw", args.disk_mb)
    best_bw = float(disk["best_bytes_s"])  # type: ignore[arg-type]
    one_bw = float(disk["one_stream_bytes_s"])  # type: ignore[arg-type]
    bare_tok_s = max(bare_tok_s, bare2)
    cap_tok_s = max(cap_at.values())
    print(
        f"\nhsq benchmark: {args.label or args.model + '/' + args.device}, {len(samples)} "
        f"samples, {total_tokens} tokens ({args.min_len}-{args.max_len} per sample)"
    )
    print(f"  {'bare server, one request at a time':<44} {bare_tok_s:>12,.0f} tokens/s")
    for k, v in cap_at.items():
        print(f"  {f'capacity, {k} in flight (no persistence)':<44} {v:>12,.0f} tokens/s")
    print(f"  {'straightforward way (sequential)':<44} {naive_tok_s:>12,.0f} tokens/s")
    print("  disk, durable GB/s:", ", ".join(f"{k} {v}" for k, v in disk["gb_s"].items()))  # type: ignore[attr-defined]
    rows = []
    for k, res in hsq_res.items():
        bpt = res["bytes_per_token"]
        storage_tok_s, one_tok_s = best_bw / bpt, one_bw / bpt
        hsq_tok_s = res["tok_s"]
        row = {
            "label": args.label or f"{args.model}/{args.device}",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.node()} {os.cpu_count()} cpus",
            "samples": len(samples),
            "tokens": total_tokens,
            "inflight": k,
            "bare_tok_s": round(bare_tok_s, 1),
            "capacity_tok_s": round(cap_tok_s, 1),
            "capacity_inflight": max(cap_at, key=lambda x: cap_at[x]),
            "capacity_at_inflight_tok_s": round(cap_at[k], 1),
            "hsq_tok_s": round(hsq_tok_s, 1),
            "naive_tok_s": round(naive_tok_s, 1),
            "storage_bound_tok_s": round(storage_tok_s, 1),
            "storage_one_stream_tok_s": round(one_tok_s, 1),
            "disk_write_gb_s": round(best_bw / 1e9, 3),
            "disk_best_design": disk["best"],
            "disk_one_stream_gb_s": round(one_bw / 1e9, 3),
            "bytes_per_token": round(bpt, 1),
            "efficiency": round(hsq_tok_s / bare_tok_s, 3),
            "efficiency_vs_bound": round(hsq_tok_s / min(bare_tok_s, storage_tok_s), 3),
            "efficiency_vs_capacity": round(hsq_tok_s / min(cap_tok_s, storage_tok_s), 3),
            "speedup_vs_naive": round(hsq_tok_s / naive_tok_s, 3),
            "redis_cmds_per_sample": round(res["redis_cmds_per_sample"], 2),
            "worker_peak_rss_mb": res["worker_peak_rss_mb"],
            "hsq_done": res["done"],
        }
        rows.append(row)
    print(
        f"\n  {'K':>3} {'hsq tok/s':>11} {'hsq/bare':>9} {'hsq/min(bare,stor)':>19} "
        f"{'hsq/min(cap,stor)':>18} {'storage tok/s':>14} {'Redis/sample':>13} {'RSS MB':>8}"
    )
    for r in rows:
        print(
            f"  {r['inflight']:>3} {r['hsq_tok_s']:>11,.0f} {r['efficiency']:>9.3f} "
            f"{r['efficiency_vs_bound']:>19.3f} {r['efficiency_vs_capacity']:>18.3f} "
            f"{r['storage_bound_tok_s']:>14,.0f} {r['redis_cmds_per_sample']:>13.2f} "
            f"{r['worker_peak_rss_mb']:>8.1f}"
        )
    print("  server, median per request:", server_breakdown(work / "server.log"))
    shutil.rmtree(out_root, ignore_errors=True)
    shutil.rmtree(dump_root, ignore_errors=True)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
