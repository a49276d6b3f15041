"""A whole node: one reference server and one worker per GPU, one Redis, the exporter and
(when a binary is given) Prometheus; scaling from 1 GPU to all of them, side by side.

Phase "bare": a clear-send-scan loop on GPU 0's server (one request at a time).
Phase "capacity": K requests in flight on GPU 0's batching server, no persistence.
Phase "1 gpu": hsq with one server/worker pair.  Phase "N gpus": hsq with every pair.
Reports aggregate tokens/s against N x bare and against min(N x capacity, storage bound)
(the disk's best durable rate, bench/disk.py), Redis commands/s and CPU, and what the
dashboard's queries return from Prometheus. `--inflight K` goes to the workers when K != 1.

    python -m bench.node --model llama-8b --samples-per-gpu 60 --out-root /root \\
        --prometheus .prom/prometheus

`python -m bench.node --null ...` is the node with null-model servers instead
(bench/null_node.py: N servers and N workers on one host, one output disk, no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.disk import probe
from bench.pipeline import bare, capacity, load_samples
from hsq.node import procs
from hsq.producer.enqueue import enqueue_run
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect, redis_calls

ROOT = Path(__file__).resolve().parents[1]


def worker_window(logs: list[Path]) -> tuple[float, int, int]:
    """(seconds from the first request to the last done, tokens, bytes) over all workers."""
    starts, ends, tokens, nbytes = [], [], 0, 0
    for log in logs:
        for line in log.read_text().splitlines():
            if not line.startswith("{"):
                continue
            e = json.loads(line)
            if e.get("event") != "sample_done":
                continue
            t = time.mktime(time.strptime(e["timestamp"][:19], "%Y-%m-%dT%H:%M:%S")) + float(
                "0." + e["timestamp"][20:26]
            )
            took = (e["request_ms"] + e["wait_ms"] + e["stage_ms"] + e["persist_ms"]) / 1e3
            starts.append(t - took)
            ends.append(t)
            tokens += int(e["tokens"])
            nbytes += int(e["bytes"])
    return max(ends) - min(starts), tokens, nbytes


def redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def hsq_phase(
    n: int,
    servers: list[procs.ReferenceServer],
    redis_url: str,
    ds: Path,
    out: Path,
    work: Path,
    metrics_ports: list[int],
    prom: str | None = None,
    inflight: int = 1,
) -> dict[str, Any]:
    client = connect(redis_url)
    run = f"node{n}-{ds.stem}"
    store = RunStore(client, run)
    enqueue_run(store, RunConfig(run=run, dataset=str(ds), out=str(out)), progress=False)
    c0, cpu0, t0 = redis_calls(client), redis_cpu(client), time.perf_counter()
    workers = [
        procs.worker_process(
            run,
            s.url,
            s.dump_dir,
            redis_url,
            work / f"{run}-w{i}.log",
            "--burst",
            "--name",
            f"gpu{i}",
            "--metrics-port",
            str(metrics_ports[i]),
            "--metrics-host",
            "127.0.0.1",
            *(["--inflight", str(inflight)] if inflight != 1 else []),
        )
        for i, s in enumerate(servers[:n])
    ]
    snapshot: list[str] = []
    total = store.count(store.keys.index)
    started = time.monotonic()
    while any(w.alive() for w in workers):
        # The dashboard as an operator sees it mid-run, once 60% is done.
        done_now = store.count(store.keys.done)
        late = done_now >= 0.6 * total and time.monotonic() - started > 8
        if prom and not snapshot and (late or done_now >= 0.9 * total):
            snapshot = dashboard_values(prom)
        time.sleep(0.5)
    rcs = [w.proc.wait(60) for w in workers]
    wall = time.perf_counter() - t0
    calls, cpu = redis_calls(client) - c0 - 1, redis_cpu(client) - cpu0
    secs, tokens, nbytes = worker_window([w.log_path for w in workers])
    done = store.count(store.keys.done)
    return {
        "gpus": n,
        "rc": rcs,
        "done": done,
        "tok_s": tokens / secs,
        "gb_s": nbytes / secs / 1e9,
        "redis_cmds_per_sample": calls / max(done, 1),
        "redis_cmds_per_s": calls / wall,
        "redis_cpu_pct": 100 * cpu / wall,
        "dashboard": snapshot,
    }


def prometheus_report(
    binary: str,
    work: Path,
    metrics_ports: list[int],
    exporter_port: int,
) -> tuple[procs.ManagedProcess, str]:
    conf = work / "prom"
    (conf / "targets/workers").mkdir(parents=True)
    (conf / "targets/exporter").mkdir(parents=True)
    (conf / "targets/workers/node.json").write_text(
        json.dumps([{"targets": [f"127.0.0.1:{p}" for p in metrics_ports]}])
    )
    (conf / "targets/exporter/node.json").write_text(
        json.dumps([{"targets": [f"127.0.0.1:{exporter_port}"]}])
    )
    text = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    text = text.replace("scrape_interval: 15s", "scrape_interval: 2s").replace(
        "refresh_interval: 30s", "refresh_interval: 2s"
    )
    (conf / "prometheus.yml").write_text(text)
    (conf / "alerts.yml").write_text((ROOT / "deploy/prometheus/alerts.yml").read_text())
    port = procs.free_port()
    proc = procs.ManagedProcess(
        [
            binary,
            f"--config.file={conf / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        work / "prom.log",
    )
    url = f"http://127.0.0.1:{port}"
    procs.wait_http_ok(url + "/-/ready", proc, timeout=60)
    return proc, url


def dashboard_values(prom: str) -> list[str]:
    dash = json.loads((ROOT / "deploy/grafana/dashboards/hsq.json").read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            q = t["expr"].replace("$__rate_interval", "1m").replace('run=~"$run"', 'run=~".*"')
            res = httpx.get(prom + "/api/v1/query", params={"query": q}).json()["data"]["result"]
            vals = [
                f"{'/'.join(v for k, v in r['metric'].items() if k != '__name__') or '-'}="
                f"{float(r['value'][1]):.4g}"
                for r in res[:4]
            ]
            out.append(f"{panel['title']} [{t['legendFormat']}]: {', '.join(vals) or 'no data'}")
    return out


def main() -> None:
    import sys

    if "--null" in sys.argv[1:]:  # the null-model node: no GPU, no torch model
        from bench.null_node import main as null_main

        null_main(sys.argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--samples-per-gpu", type=int, default=60)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--out-root", default=None)
    ap.add_argument("--prometheus", default=None, help="path of a prometheus binary")
    ap.add_argument("--inflight", type=int, default=1, help="hsq worker --inflight K")
    ap.add_argument("--capacity-inflight", type=int, default=16)
    args = ap.parse_args()
    n = args.gpus
    work = Path(tempfile.mkdtemp(prefix="hsq-node-"))
    out_root = Path(tempfile.mkdtemp(prefix="hsq-node-out-", dir=args.out_root))
    dumps = Path(tempfile.mkdtemp(prefix="hsq-node-dumps-", dir="/dev/shm"))
    vocab = 128256 if args.model == "llama-8b" else 32000
    ds1, dsn = work / "one.jsonl", work / "all.jsonl"
    write_synthetic(
        ds1, args.samples_per_gpu, seed=1, min_len=args.min_len, max_len=args.max_len, vocab=vocab
    )
    write_synthetic(
        dsn,
        args.samples_per_gpu * n,
        seed=2,
        min_len=args.min_len,
        max_len=args.max_len,
        vocab=vocab,
    )
    redis_srv = procs.RedisServer(
        work / "redis", password=secrets.token_hex(8), appendonly=True
    ).wait_ready()
    eport = procs.free_port()
    exporter = procs.exporter_process(redis_srv.url, eport, work / "exp.log")
    servers = [
        procs.ReferenceServer(
            dumps / f"d{i}",
            work / f"server{i}.log",
            args=[
                "--model",
                args.model,
                "--device",
                args.device,
                "--no-fsync",
                "--warmup",
                "2",
                "--max-batch-requests",
                str(max(16, args.capacity_inflight)),
            ],
            env={"CUDA_VISIBLE_DEVICES": str(i)},
        )
        for i in range(n)
    ]
    mports = [procs.free_port() for _ in range(n)]
    prom = None
    try:
        for s in servers:
            s.wait_ready(timeout=900)
        if args.prometheus:
            prom, prom_url = prometheus_report(args.prometheus, work, mports, eport)
        bare_1 = bare(servers[0], load_samples(ds1)[: max(10, args.samples_per_gpu // 2)])
        capacity(servers[0], load_samples(ds1)[:8], 4)  # warm-up: connections, batch shapes
        cap_1 = capacity(servers[0], load_samples(ds1), args.capacity_inflight)
        one = hsq_phase(1, servers, redis_srv.url, ds1, out_root, work, mports, None, args.inflight)
        alln = hsq_phase(
            n,
            servers,
            redis_srv.url,
            dsn,
            out_root,
            work,
            mports,
            prom_url if prom else None,
            args.inflight,
        )
        disk = probe(out_root / "bw", total_mb=1024)
        bw = float(disk["best_bytes_s"])  # type: ignore[arg-type]
        lines = alln["dashboard"]
    finally:
        for s in servers:
            s.stop()
        exporter.stop()
        if prom:
            prom.stop()
        redis_srv.stop()
    storage_tok_s = bw / (alln["gb_s"] * 1e9 / alln["tok_s"])  # bytes per token of the run
    row = {
        "date": time.strftime("%Y-%m-%d"),
        "gpus": n,
        "model": args.model,
        "cpus": os.cpu_count(),
        "bare_1gpu_tok_s": round(bare_1, 1),
        "hsq_1gpu_tok_s": round(one["tok_s"], 1),
        "hsq_all_tok_s": round(alln["tok_s"], 1),
        "scaling": round(alln["tok_s"] / one["tok_s"], 3),
        "vs_n_x_bare": round(alln["tok_s"] / (n * bare_1), 3),
        "inflight": args.inflight,
        "capacity_1gpu_tok_s": round(cap_1, 1),
        "storage_bound_tok_s": round(storage_tok_s, 1),
        "vs_min_n_x_capacity_storage": round(alln["tok_s"] / min(n * cap_1, storage_tok_s), 3),
        "output_gb_s": round(alln["gb_s"], 3),
        "disk_write_gb_s": round(bw / 1e9, 3),
        "disk_best_design": disk["best"],
        "disk_one_stream_gb_s": round(float(disk["one_stream_bytes_s"]) / 1e9, 3),  # type: ignore[arg-type]
        "redis_cmds_per_sample": round(alln["redis_cmds_per_sample"], 2),
        "redis_cmds_per_s": round(alln["redis_cmds_per_s"], 1),
        "redis_cpu_pct": round(alln["redis_cpu_pct"], 2),
        "done": [one["done"], alln["done"]],
    }
    print(f"\nnode benchmark: {n} GPUs, {args.model}, {args.min_len}-{args.max_len} tokens")
    for k, v in row.items():
        print(f"  {k:<24} {v}")
    for line in lines:
        print("  dashboard:", line)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
