"""FP8 storage against bf16: bytes per token, reconstruction error, CPU cost, throughput.

    python -m bench.fp8 --what bytes,error,cost --model tiny                 # CPU, reference model
    python -m bench.fp8 --what bytes,error,cost --model llama-8b --device cuda
    python -m bench.fp8 --what persist --persist-out /mnt/slow --shape llama-8b

bytes:   output file bytes per token, both formats, from write_output on a real dump.
error:   per tensor (each aux layer, the last state): relative L2 error per token
         ||x - deq(q(x))|| / ||x|| (mean, worst) and cosine (mean, worst), on the model's
         states for synthetic prompts. With random weights: says nothing of drafter quality.
cost:    CPU time of quant.quantize per token (the worker's persist-stage cost), by threads.
persist: the worker's persist stage alone (open_dump_tensors with its finite check, then
         write_output: temp file, fsync, rename, fsync dir) for the same dumps on tmpfs, with
         `--threads` threads, into --persist-out; tokens/s for bf16 and fp8 and the ratio.
         Point --persist-out at a slow disk to see the storage-bound regime.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hsq import quant
from hsq.dataset.jsonl import Sample
from hsq.dump.format import DumpMeta, ModelIdentity, expected_shapes, fingerprint
from hsq.dump.read import open_dump_tensors
from hsq.dump.write import write_dump
from hsq.engines.reference.model import load_model
from hsq.engines.reference.shapes import eagle3_default_layers, shape_config
from hsq.outputs.transcode import write_output
from hsq.states import AUX_TENSOR, FP8, LAST_TENSOR, STORE_DTYPES
from hsq.stfile.engine import WriteEngine

FORMATS = STORE_DTYPES


def _meta(n: int, layers: list[int], h: int, index: int) -> tuple[DumpMeta, list[int]]:
    ids = [(7 * i + index) % 32000 for i in range(n)]
    ident = ModelIdentity("bench", "LlamaModel", 32, h, "0" * 64)
    meta = DumpMeta(
        f"r{index}",
        n,
        fingerprint(ids),
        layers,
        h,
        "bfloat16",
        ident,
        expected_shapes(n, len(layers), h),
        index,
    )
    return meta, ids


def make_dumps(
    where: Path, shape: str, count: int, length: int
) -> list[tuple[Path, DumpMeta, list[int]]]:
    """Dumps as the server writes them, with states of a hidden-state-like spread (a few
    large channels, as real residual streams have); the content only matters for cost."""
    cfg = shape_config(shape)
    h, layers = int(cfg["hidden_size"]), eagle3_default_layers(int(cfg["num_hidden_layers"]))
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        aux = torch.randn(length, len(layers) * h, generator=gen)
        aux[:, :: max(1, h // 8)] *= 20
        last = torch.randn(length, h, generator=gen)
        tensors = {
            AUX_TENSOR: aux.to(torch.bfloat16),
            LAST_TENSOR: last.to(torch.bfloat16),
        }
        meta, ids = _meta(length, layers, h, i)
        out.append((write_dump(where, i, meta, tensors, fsync=False), meta, ids))
    return out


def persist_one(
    engine: WriteEngine,
    dump: tuple[Path, DumpMeta, list[int]],
    out: Path,
    fmt: str,
    name: str,
    skip_finite: bool = False,
) -> tuple[int, int]:
    path, meta, ids = dump
    # The worker's validation, finite check included (fp8 may skip it: the quantizer
    # refuses NaN and Inf itself; --skip-finite measures what that would save).
    check = not (skip_finite and fmt == FP8)
    tensors = open_dump_tensors(path, meta, check_finite=check)
    try:
        sample = Sample(name, ids, None)
        path = out / f"{name}.safetensors"
        nbytes, _ = write_output(path, sample, meta, tensors, "bench", fmt, engine=engine)
    finally:
        tensors.close()
    return len(ids), nbytes


def bench_bytes(shape: str, length: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        root = Path(tmp)
        (root / "d").mkdir()
        dump = make_dumps(root / "d", shape, 1, length)[0]
        res = {}
        for fmt in FORMATS:
            with WriteEngine() as engine:
                _, nbytes = persist_one(engine, dump, root / fmt, fmt, "s")
            res[fmt] = nbytes / length
    res["ratio"] = res["fp8-e4m3"] / res["bf16"]
    return res


def _row_stats(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    x, y = x.float(), y.float()
    ref = x.norm(dim=-1)
    keep = ref > 0
    rel = (x - y).norm(dim=-1)[keep] / ref[keep]
    cos = torch.nn.functional.cosine_similarity(x[keep], y[keep], dim=-1)
    return {
        "rel_l2_mean": float(rel.mean()),
        "rel_l2_worst": float(rel.max()),
        "cos_mean": float(cos.mean()),
        "cos_worst": float(cos.min()),
        "tokens": int(keep.sum()),
    }


def bench_error(model_name: str, device: str, lengths: list[int]) -> dict[str, Any]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(
        model_name, device=device, dtype=dtype, dump_dtype=torch.bfloat16, layers=None
    )
    gen = torch.Generator().manual_seed(1)
    per: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    h, layers = model.hidden_size, model.layer_ids
    for n in lengths:
        ids = torch.randint(0, model.vocab_size, (n,), generator=gen).tolist()
        cap = model.forward(ids)
        aux, last = cap.aux.cpu(), cap.last.cpu()  # quantized on the CPU, as the worker does
        for name, x, groups in ((AUX_TENSOR, aux, len(layers)), (LAST_TENSOR, last, 1)):
            y = quant.dequantize(*quant.quantize(x, groups))
            for g in range(groups):
                key = f"aux layer {layers[g]}" if name == AUX_TENSOR else name
                sl = slice(g * h, (g + 1) * h)
                per.setdefault(key, []).append((x[:, sl], y[:, sl]))
    return {
        key: _row_stats(torch.cat([a for a, _ in v]), torch.cat([b for _, b in v]))
        for key, v in per.items()
    }


def bench_cost(shape: str, length: int, threads: list[int]) -> dict[str, Any]:
    cfg = shape_config(shape)
    h, k = int(cfg["hidden_size"]), len(eagle3_default_layers(int(cfg["num_hidden_layers"])))
    aux = torch.randn(length, k * h).to(torch.bfloat16)
    last = torch.randn(length, h).to(torch.bfloat16)
    before = torch.get_num_threads()
    res = {}
    for t in threads:
        torch.set_num_threads(t)
        quant.quantize(aux[:256], k)  # warm up
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            quant.quantize(aux, k)
            quant.quantize(last, 1)
            runs.append(time.perf_counter() - t0)
        best = min(runs)
        res[f"{t} threads"] = {
            "us_per_token": round(best / length * 1e6, 2),
            "tokens_per_s": round(length / best),
        }
    torch.set_num_threads(before)
    return res


def _cgroup_written(cgroup: Path | None, device: str) -> int:
    """Bytes a blkio (v1) cgroup wrote to `device` (major:minor): proves the throttle saw
    the writes (writeback by kernel flusher threads would escape it)."""
    if cgroup is None:
        return 0
    for line in (cgroup / "blkio.throttle.io_service_bytes").read_text().splitlines():
        parts = line.split()
        if parts[:2] == [device, "Write"]:
            return int(parts[2])
    return 0


def bench_persist(
    shape: str,
    out: Path,
    samples: int,
    length: int,
    threads: int,
    distinct: int,
    cgroup: Path | None = None,
    device: str = "",
    formats: tuple[str, ...] = FORMATS,
    skip_finite: bool = False,
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        dumps = make_dumps(Path(tmp), shape, min(distinct, samples), length)
        for fmt in formats:
            target = out / f"fp8bench-{fmt}"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            os.sync()  # start from a clean page cache state on the output disk
            jobs = [
                (dumps[i % len(dumps)], target, fmt, f"s{i}", skip_finite) for i in range(samples)
            ]
            seen = _cgroup_written(cgroup, device)
            t0 = time.perf_counter()
            with WriteEngine() as engine, ThreadPoolExecutor(threads) as pool:
                done = list(pool.map(lambda job: persist_one(engine, *job), jobs))
            elapsed = time.perf_counter() - t0
            tokens = sum(t for t, _ in done)
            nbytes = sum(b for _, b in done)
            res[fmt] = {
                "tokens_per_s": round(tokens / elapsed),
                "MB_per_s": round(nbytes / elapsed / 1e6, 1),
                "seconds": round(elapsed, 2),
                "tokens": tokens,
            }
            if cgroup is not None:
                through = _cgroup_written(cgroup, device) - seen
                res[fmt]["share_through_throttle"] = round(through / nbytes, 3)
            print(fmt, json.dumps(res[fmt]), flush=True)
            shutil.rmtree(target, ignore_errors=True)
    if len(formats) == 2:
        ratio = res["fp8-e4m3"]["tokens_per_s"] / res["bf16"]["tokens_per_s"]
        res["fp8_over_bf16"] = round(ratio, 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", default="bytes,error,cost")
    ap.add_argument("--model", default="tiny", help="model for `error` (tiny on CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="shape for bytes/cost/persist [--model]")
    ap.add_argument("--lengths", default="128,512,1024", help="prompt lengths for `error`")
    ap.add_argument("--length", type=int, default=2048, help="tokens per sample elsewhere")
    ap.add_argument("--threads", default="1,2", help="torch threads for `cost`")
    ap.add_argument("--persist-out", type=Path, default=None)
    ap.add_argument("--persist-samples", type=int, default=24)
    ap.add_argument("--persist-threads", type=int, default=2, help="worker default: 2")
    ap.add_argument("--distinct", type=int, default=4, help="distinct dumps on tmpfs, reused")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--skip-finite", action="store_true", help="fp8: no separate finite scan")
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--blkio-cgroup", type=Path, default=None, help="report its write bytes")
    ap.add_argument("--blkio-device", default="7:0", help="major:minor of the output disk")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    shape = a.shape or a.model
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    what = set(a.what.split(","))
    results: dict[str, Any] = {"shape": shape, "model": a.model, "device": a.device}
    if "bytes" in what:
        results["bytes_per_token"] = bench_bytes(shape, a.length)
        print("bytes per token", json.dumps(results["bytes_per_token"]), flush=True)
    if "error" in what:
        lengths = [int(x) for x in a.lengths.split(",")]
        results["error"] = bench_error(a.model, a.device, lengths)
        for key, st in results["error"].items():
            print(f"error {key:>18}", json.dumps({k: round(v, 5) for k, v in st.items()}))
    if "cost" in what:
        threads = [int(x) for x in a.threads.split(",")]
        results["quantize_cost"] = bench_cost(shape, a.length, threads)
        print("quantize cost", json.dumps(results["quantize_cost"]), flush=True)
    if "persist" in what:
        if a.persist_out is None:
            ap.error("--what persist needs --persist-out")
        results["persist"] = bench_persist(
            shape,
            a.persist_out,
            a.persist_samples,
            a.length,
            a.persist_threads,
            a.distinct,
            a.blkio_cgroup,
            a.blkio_device,
            tuple(a.formats.split(",")),
            a.skip_finite,
        )
        print("persist", json.dumps(results["persist"]), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
