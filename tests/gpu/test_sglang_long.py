"""Long samples live: 16K, 32K and 64K tokens (HSQ_LIVE_LONG) through `hsq run --engine
sglang` on one GPU, at Llama-3-8B's widths (hidden 4096, HSQ_LIVE_LONG_LAYERS decoder
layers of random weights: the bytes per token are the 8B's), chunked prefill on (8192).

Every sample must end done and verified, and equal the float32 reference forward of the
same checkpoint (the rule of tests/gpu/equality.py) up to HSQ_LIVE_LONG_REFERENCE_MAX
tokens; the results say, per sample, the worker's peak resident memory (alone and with its
persist processes), the dump dir's peak bytes on /dev/shm, the output's bytes and the
bytes per token docs/outputs.md states. One sample at a time (--inflight 1), so each
reading belongs to one sample (tests/gpu/longctx.py).

    scripts/sglang_live.sh --job long="tests/gpu/test_sglang_long.py"
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from hsq.node.procs import hsq_command
from hsq.node.supervisor import dump_root
from tests.gpu import equality as eq
from tests.gpu import longctx as lc
from tests.gpu.extract import log_events, make_dataset
from tests.gpu.models import LLAMA8B_SHAPE, write_llama8b_width
from tests.gpu.reference import LAST, Reference
from tests.gpu.results import Results
from tests.gpu.settings import LiveSettings
from tests.support.sglang import SGLANG_FLAGS

CHUNK = 8192
LAYERS = "1,3,5"  # EAGLE-3's three aux layers, as the 8-layer test Llama names them
SECTION = "long_context"


def test_long_samples_through_hsq_run(
    live: LiveSettings, results: Results, models_root: Path, fresh: tuple[Path, Path]
) -> None:
    wd, _ = fresh
    lengths = list(live.long)
    context = max(131072, 2 * max(lengths))
    t = time.monotonic()
    model = write_llama8b_width(
        models_root / f"llama8bw-{live.long_layers}", layers=live.long_layers, seed=3,
        device="cuda", context=context,
    )  # fmt: skip
    results.record(SECTION, model=f"Llama-3-8B widths, {live.long_layers} layers, random bf16",
                   model_write_s=round(time.monotonic() - t, 1))  # fmt: skip
    engine = ["--engine", "sglang", "--gpus", "0", "--model", str(model)]
    server = [
        "--layers", LAYERS, "--mem-fraction-static", "0.35", "--max-total-tokens", str(context),
        "--context-length", str(context), "--chunked-prefill-size", str(CHUNK),
        "--max-running-requests", "4", *SGLANG_FLAGS,
    ]  # fmt: skip
    run_long(results, wd, model, engine, server, lengths, LLAMA8B_SHAPE["hidden_size"],
             LLAMA8B_SHAPE["vocab_size"], live.long_reference_max, "cuda")  # fmt: skip


def run_long(
    results: Results, wd: Path, model: Path, engine: list[str], server: list[str],
    lengths: list[int], hidden: int, vocab: int, reference_max: int, device: str,
) -> None:  # fmt: skip
    """One `hsq run` of `lengths`, one sample at a time, watched; every figure recorded
    (section long_context) before anything is asserted."""
    per_token = lc.dump_bytes_per_token(hidden, 3, prenorm=False, fp8=False)
    results.record(
        SECTION, lengths=lengths, chunked_prefill=CHUNK, bytes_per_token=per_token,
        planned_sample_bytes={n: n * per_token for n in lengths},
    )  # fmt: skip
    ds = wd / "long.jsonl"
    data = make_dataset(ds, lengths, vocab=vocab, seed=11, prefix="long")
    out, run = wd / "out", "long"
    argv = hsq_command(
        "--log-format", "json", "run", str(ds), "--run", run, "--out", str(out), *engine,
        "--json", "--verify", "--inflight", "1", "--dump-timeout", "300", "--", *server,
    )  # fmt: skip
    shm = dump_root()
    st = os.statvfs(shm)
    # What bounds a dump: the tmpfs it is written to (a 64K-token sample at 8B width is 2 GiB).
    results.record(SECTION, shm_size=st.f_blocks * st.f_frsize, shm_free=st.f_bavail * st.f_frsize)

    def dump_dirs() -> list[Path]:
        return sorted(shm.glob(f"hsq-{run}-*"))

    start = time.time()
    with lc.Watch(run, dump_dirs, shm) as watch:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=1500,
                           stdin=subprocess.DEVNULL)  # fmt: skip
    seconds = round(time.time() - start, 1)
    (wd / "run.stdout").write_text(r.stdout)
    (wd / "run.stderr").write_text(r.stderr)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    summary = json.loads(lines[-1]) if lines else {}
    wlog = out / ".hsq" / "logs" / "worker-0.log"
    done = lc.done_times(list(log_events(wlog, "sample_done"))) if wlog.exists() else []
    files = {p.stem: p.stat().st_size for p in (out / run).rglob("*.safetensors")}
    samples = lc.per_sample(done, watch.points, start)
    for sid, fig in samples.items():
        n = len(data.get(sid, []))
        fig.update(tokens=n, output_bytes=files.get(sid, 0), planned_bytes=n * per_token)
    results.record(
        SECTION, exit=r.returncode, seconds=seconds, summary=summary, per_sample=samples,
        done_order=[s for s, _ in done], worker_hwm=watch.worker_hwm, readings=len(watch.points),
        shm=str(shm), view=[x for x in r.stdout.splitlines() if x.startswith("progress")][-8:],
        stderr_tail=r.stderr.splitlines()[-20:] if r.returncode else [],
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["status"]["done"] == len(lengths) and summary["status"]["dead"] == 0
    assert summary["verified"] == {"checked": len(lengths), "ok": len(lengths), "problems": 0}
    for sid, ids in data.items():  # the output holds every token's states
        assert files.get(sid, 0) >= len(ids) * per_token, (sid, files.get(sid))

    equality = compare(model, out / run, data, reference_max, device)
    results.record(SECTION, equality=equality)
    bad = {k: v for k, v in equality.items() if isinstance(v, dict) and v.get("ok") is False}
    assert not bad, bad


def compare(
    model: Path, run_dir: Path, data: dict[str, list[int]], longest: int, device: str
) -> dict[str, Any]:
    """Each output against the float32 forward (after `hsq run` stopped its server, so the
    GPU is the reference's); a sample past `longest`, or one whose forward does not fit the
    GPU, is reported with the reason instead."""
    import torch

    from hsq.outputs import open_output

    layer_ids: list[int] | None = None
    files = {p.stem: p for p in run_dir.rglob("*.safetensors")}
    for f in files.values():
        layer_ids = json.loads(open_output(f).metadata["layer_ids"])
        break
    if layer_ids is None:
        return {"error": "no output files"}
    ref = Reference(model, device, keep={*layer_ids, LAST})
    out: dict[str, Any] = {"layer_ids": layer_ids}
    for sid in sorted(data, key=lambda s: len(data[s])):
        ids = data[sid]
        if len(ids) > longest:
            out[sid] = {"tokens": len(ids), "compared": False,
                        "why": f"longer than HSQ_LIVE_LONG_REFERENCE_MAX={longest}"}  # fmt: skip
            continue
        t = time.monotonic()
        try:
            states = ref.states(ids)
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            why = f"the float32 forward does not fit the GPU: {exc}"[:300]
            out[sid] = {"tokens": len(ids), "compared": False, "why": why}
            continue
        o = open_output(files[sid])
        want = eq.expected_tensors(states, layer_ids, prenorm=False, fp8=False, last_key=LAST)
        c = eq.compare(eq.stored_tensors(o), want)
        out[sid] = {
            "tokens": len(ids), "compared": True, "ok": c.ok, "rows": c.rows,
            "bad_rows": c.bad_rows, "min_cosine": round(c.min_cosine, 6),
            "max_abs_over_norm": round(c.max_abs_over_norm, 6),
            "ids_exact": o.input_ids.tolist() == ids,
            "forward_s": round(time.monotonic() - t, 1),
            "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if device == "cuda" else None,
        }  # fmt: skip
        if not out[sid]["ids_exact"]:
            out[sid]["ok"] = False
        del states, want, o
    del ref
    if device == "cuda":
        torch.cuda.empty_cache()
    return out
