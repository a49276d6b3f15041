"""The checks of scripts/vllm_live.sh, one subcommand per phase; each writes a JSON result.

tiny DIR                       a tiny random Llama (tests.support.tinymodel) whose final
                               norm weight is not all ones (so the post-norm is tested)
one URL DUMP_DIR MODEL LAYERS  one short and one long (chunked) prompt through the
                               connector: the dumps hsq reads back against a float32
                               transformers forward (hsq.closeness.rule's tolerance)
outputs REDIS RUN OUT MODEL DATA LAYERS N
                               N of a run's stored samples against the same forward
capacity URL N K [--rid]       N completions, K in flight: tokens/s (with --rid each
                               request carries an hsq rid, so the connector dumps it;
                               --sweep DIR removes finished dumps from DIR as they come,
                               as a worker would, so tmpfs never fills)
config8b DIR                   Llama-3-8B's config alone (served with --load-format dummy)
rate LOG                       a worker's steady tokens/s from its JSON log (first to last
                               sample_done), as bench/sglang_capacity.py measures it
best LABEL...                  of capacity-LABEL.json files, the one with the most tokens/s
ratios                         connector / plain vLLM at its best K, hsq's worker / connector
moe REDIS RUN OUT MODEL DATA LAYERS DENSE
                               every stored sample of an MoE run against the float32
                               forward under the MoE rule (tests/gpu/equality.compare_moe:
                               aux ids <= DENSE row by row, the rest under the allowance)
fp8 REDIS RUN OUT MODEL DATA LAYERS
                               every stored sample of an fp8-e4m3 run against the float32
                               forward quantized the same way, under the fp8 rule (every
                               row: cosine >= 0.999, max |d| <= 10 % of the row norm)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hsq.closeness.rule import closeness
from hsq.dump.find import scan_by_rid
from hsq.dump.format import fingerprint
from hsq.dump.read import Expected, read_dump
from hsq.states import AUX_TENSOR, LAST_TENSOR, PRENORM_TENSOR
from hsq.workers.send.client import VllmClient

OUT = Path(os.environ.get("RESULTS", "live-results"))


def emit(name: str, result: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"[vllm_live_check] {name}: {json.dumps(result)[:600]}", flush=True)


def tiny(out: Path) -> None:
    """8 layers (the run's 2,4,5; vLLM's 2,4,5,8), hidden 512 and head_dim 128: vLLM's
    TRITON_ATTN needs head_dim >= 32 (v1/attention/backends/triton_attn.py:386), so the
    tests' 64-wide tiny model would not start. A final norm weight not all ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.copy_(1 + 0.3 * torch.randn(512))
    model.save_pretrained(out)


_MODELS: dict[str, Any] = {}


def reference(model: str, ids: list[int], layers: list[int]) -> dict[str, torch.Tensor]:
    """HF hidden_states[i] for the aux layers, hidden_states[-1] (post-norm) and the last
    decoder layer's output (pre-norm), in float32."""
    from transformers import AutoModelForCausalLM

    if model not in _MODELS:
        _MODELS[model] = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    m = _MODELS[model]
    seen: dict[str, torch.Tensor] = {}
    hook = m.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("pre", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.inference_mode():
            hs = m.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return {
        AUX_TENSOR: torch.cat([hs[i][0] for i in layers], dim=-1),
        LAST_TENSOR: hs[-1][0],
        PRENORM_TENSOR: seen["pre"][0],
    }


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], h: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, ref in want.items():
        if name not in got:
            continue
        x = got[name].float()
        # per layer for aux: a wrong layer order shows as one bad slice
        for k in range(ref.shape[1] // h):
            c = closeness(x[:, k * h : (k + 1) * h], ref[:, k * h : (k + 1) * h])
            out[f"{name}[{k}]"] = {
                "ok": c.ok,
                "min_cos": c.min_cosine,
                "max_rel": c.max_abs_over_norm,
            }
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def one(url: str, dump_dir: Path, model: str, layers: list[int]) -> int:
    client = VllmClient(url, request_timeout=300)
    results: dict[str, Any] = {}
    for label, n in (("short", 5), ("long_chunked", 1500)):
        ids = [(i * 37 + 11) % 1000 for i in range(n)]
        rid = f"hsq-live-{label}-a0-{os.getpid():08x}"
        t0 = time.monotonic()
        answer = client.prefill(ids, rid)
        found = None
        while time.monotonic() - t0 < 120 and found is None:
            found = scan_by_rid(dump_dir).complete.get(rid)
            time.sleep(0.05)
        if not found:
            results[label] = {"ok": False, "why": "no dump within 120 s", "answer": answer.raw}
            continue
        exp = Expected(rid=rid, input_fingerprint=fingerprint(ids), num_tokens=n, layer_ids=layers)
        dump = read_dump(found[0].path, exp)
        want = reference(model, ids, layers)
        r = compare(dump.tensors, want, dump.meta.hidden_size)
        r.update(
            prompt_tokens=answer.prompt_tokens, dumps=len(found), seconds=time.monotonic() - t0
        )
        r["ok"] = r["ok"] and len(found) == 1 and answer.prompt_tokens == n
        results[label] = r
    results["ok"] = all(v["ok"] for v in results.values())
    emit("one", results)
    return 0 if results["ok"] else 1


def outputs(
    redis_url: str, run: str, out: Path, model: str, data: Path, layers: list[int], n: int
) -> int:
    from hsq.outputs.format import open_output
    from hsq.runstore import RunStore
    from hsq.store import connect

    st = RunStore(connect(redis_url), run)
    samples = [json.loads(line) for line in data.read_text().splitlines()]
    results: dict[str, Any] = {"done": st.count(st.keys.done), "dead": st.count(st.keys.dead)}
    checked = []
    for s in samples[:n]:
        entry = st.get_manifest(s["id"])
        if entry is None:
            checked.append({"id": s["id"], "ok": False, "why": "not done"})
            continue
        got = open_output(out / run / entry.path)
        tensors = {AUX_TENSOR: got.aux_hidden_states, LAST_TENSOR: got.last_hidden_state}
        if got.last_hidden_state_prenorm is not None:
            tensors[PRENORM_TENSOR] = got.last_hidden_state_prenorm
        r = compare(
            tensors, reference(model, s["input_ids"], layers), got.last_hidden_state.shape[1]
        )
        checked.append({"id": s["id"], "tokens": len(s["input_ids"]), **r})
    results["samples"] = checked
    results["ok"] = (
        results["dead"] == 0 and results["done"] == len(samples) and all(c["ok"] for c in checked)
    )
    emit(f"outputs-{run}", results)
    return 0 if results["ok"] else 1


def config8b(out: Path) -> None:
    from tests.gpu.models import LLAMA8B_SHAPE, llama_config

    cfg = llama_config(num_hidden_layers=32, **LLAMA8B_SHAPE)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(out)


def rate(log: Path, label: str) -> int:
    from bench.sglang_capacity import steady_rate

    r = steady_rate(log)
    emit(f"rate-{label}", {"log": log.name, **r})
    return 0 if r else 1


def best(labels: list[str]) -> int:
    """Prints the K of the fastest capacity-LABEL run (for the shell)."""
    rows = [json.loads((OUT / f"capacity-{x}.json").read_text()) for x in labels]
    top = max(rows, key=lambda r: float(r["tokens_per_s"]))
    of = {x: r["tokens_per_s"] for x, r in zip(labels, rows, strict=True)}
    emit(
        "capacity-best",
        {"inflight": top["inflight"], "tokens_per_s": top["tokens_per_s"], "of": of},
    )
    print(top["inflight"])
    return 0


def moe(
    redis_url: str, run: str, out: Path, model: str, data: Path, layers: list[int], dense: int
) -> int:
    return held(redis_url, run, out, model, data, layers, dense=dense, fp8=False)


def held(
    redis_url: str, run: str, out: Path, model: str, data: Path, layers: list[int],
    *, dense: int | None, fp8: bool,
) -> int:  # fmt: skip
    """Every stored sample of `run` against the float32 forward: under the MoE rule when
    `dense` is given (the aux ids <= dense row by row), else every row; fp8 outputs against
    the forward quantized as they were."""
    from hsq.outputs.format import open_output
    from hsq.runstore import RunStore
    from hsq.store import connect
    from tests.gpu import equality as eq
    from tests.gpu.reference import LAST, PRENORM, Reference

    st = RunStore(connect(redis_url), run)
    samples = [json.loads(line) for line in data.read_text().splitlines()]
    ref = Reference(Path(model), "cuda" if torch.cuda.is_available() else "cpu")
    dense_aux = sum(1 for i in layers if dense is not None and i <= dense)
    checked, worst, strict_failed = [], 1.0, 0
    for s in samples:
        entry = st.get_manifest(s["id"])
        if entry is None:
            checked.append({"id": s["id"], "ok": False, "why": "not done"})
            continue
        o = open_output(out / run / entry.path)
        stored = eq.stored_tensors(o)
        want = eq.expected_tensors(ref.states(s["input_ids"]), layers,
                                   prenorm=eq.PRENORM_NAME in stored, fp8=fp8,
                                   last_key=LAST, prenorm_key=PRENORM)  # fmt: skip
        strict = eq.compare(stored, want, fp8=fp8)  # MoE: reported, never judged (no replay)
        c = strict if dense is None else eq.compare_moe(
            stored, want, aux_layers=len(layers), dense_aux=dense_aux, fp8=fp8)  # fmt: skip
        strict_failed += not strict.ok
        worst = min(worst, c.min_cosine)
        ids_ok = o.input_ids.tolist() == s["input_ids"]
        checked.append({"id": s["id"], "tokens": len(s["input_ids"]), "ok": c.ok and ids_ok,
                        "bad_rows": c.bad_rows, "rows": c.rows,
                        "min_cosine": round(c.min_cosine, 6)})  # fmt: skip
    results: dict[str, Any] = {
        "done": st.count(st.keys.done), "dead": st.count(st.keys.dead),
        "rule": "every row" if dense is None else f"aux ids <= {dense} ({dense_aux} of "
        f"{len(layers)}) row by row; the rest under the MoE allowance (hsq.closeness.moe)",
        "fp8": fp8, "max_abs_over_norm_bound": 0.1 if fp8 else 0.01,
        "samples_ok": sum(c["ok"] for c in checked), "samples": len(samples),
        "worst_min_cosine": round(worst, 6),
        "samples_failing_every_row_rule": strict_failed,
        "failed": [c for c in checked if not c["ok"]][:10],
    }  # fmt: skip
    results["ok"] = results["dead"] == 0 and results["samples_ok"] == len(samples)
    emit(f"{'moe' if dense is not None else 'equal'}-{run}", results)
    return 0 if results["ok"] else 1


def ratios() -> int:
    def read(name: str) -> dict[str, Any] | None:
        p = OUT / f"{name}.json"
        return json.loads(p.read_text()) if p.exists() else None

    best_, conn, worker = read("capacity-best"), read("capacity-connector"), read("rate-worker")
    fp8 = read("capacity-connector-fp8")
    out: dict[str, Any] = {"target": 0.97}
    if best_ and conn:
        out["inflight"] = best_["inflight"]
        out["connector_over_plain"] = round(conn["tokens_per_s"] / best_["tokens_per_s"], 3)
    if best_ and fp8:
        out["connector_fp8_over_plain"] = round(fp8["tokens_per_s"] / best_["tokens_per_s"], 3)
    if conn and worker and worker.get("tok_s"):
        out["hsq_over_connector"] = round(worker["tok_s"] / conn["tokens_per_s"], 3)
    emit("ratios", out)
    return 0


def capacity(url: str, n: int, k: int, rid: bool, label: str, sweep: Path | None = None) -> int:
    import httpx

    lengths = [64 + (i * 613) % 1900 for i in range(n)]
    http = httpx.Client(base_url=url, timeout=600)

    def send(i: int) -> int:
        ids = [(j * 31 + i) % 1000 for j in range(lengths[i])]
        body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0.0}
        if rid:
            body["kv_transfer_params"] = {"hsq_rid": f"hsq-cap{i}-a0-{os.getpid():08x}"}
        r = http.post("/v1/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens"])

    from bench.sglang_capacity import dump_sweeper

    with dump_sweeper(sweep) if sweep is not None else contextlib.nullcontext():
        send(0)  # warm-up
        t0 = time.monotonic()
        with ThreadPoolExecutor(k) as pool:
            tokens = sum(pool.map(send, range(n)))
        dt = time.monotonic() - t0
    emit(
        f"capacity-{label}",
        {
            "requests": n,
            "inflight": k,
            "tokens": tokens,
            "seconds": dt,
            "tokens_per_s": tokens / dt,
            "requests_per_s": n / dt,
            "dumps": rid,
        },
    )
    return 0


def _ids(text: str) -> list[int]:
    return [int(i) for i in text.split(",")]


COMMANDS: dict[str, tuple[tuple[str, ...], Any]] = {
    "tiny": (("dir",), lambda a: tiny(Path(a.dir)) or 0),
    "config8b": (("dir",), lambda a: config8b(Path(a.dir)) or 0),
    "one": (("url", "dump_dir", "model", "layers"),
            lambda a: one(a.url, Path(a.dump_dir), a.model, _ids(a.layers))),
    "outputs": (("redis_url", "run", "out", "model", "data", "layers", "n"),
                lambda a: outputs(a.redis_url, a.run, Path(a.out), a.model, Path(a.data),
                                  _ids(a.layers), int(a.n))),
    "capacity": (("url", "n", "k", "label"),
                 lambda a: capacity(a.url, int(a.n), int(a.k), a.rid, a.label, a.sweep)),
    "rate": (("log", "label"), lambda a: rate(Path(a.log), a.label)),
    "best": ((), lambda a: best(a.labels)),
    "ratios": ((), lambda _a: ratios()),
    "moe": (("redis_url", "run", "out", "model", "data", "layers", "dense"),
            lambda a: moe(a.redis_url, a.run, Path(a.out), a.model, Path(a.data),
                          _ids(a.layers), int(a.dense))),
    "fp8": (("redis_url", "run", "out", "model", "data", "layers"),
            lambda a: held(a.redis_url, a.run, Path(a.out), a.model, Path(a.data),
                           _ids(a.layers), dense=None, fp8=True)),
}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (args, _run) in COMMANDS.items():
        sp = sub.add_parser(name)
        for arg in args:
            sp.add_argument(arg)
        if name == "capacity":
            sp.add_argument("--rid", action="store_true")
            sp.add_argument("--sweep", type=Path)
        if name == "best":
            sp.add_argument("labels", nargs="+")
    a = p.parse_args()
    return int(COMMANDS[a.cmd][1](a))


if __name__ == "__main__":
    sys.exit(main())
