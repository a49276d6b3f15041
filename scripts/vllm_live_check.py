"""The checks of scripts/vllm_live.sh, one subcommand per phase; each writes a JSON result.

tiny DIR                       a tiny random Llama (tests.support.tinymodel) whose final
                               norm weight is not all ones (so the post-norm is tested)
one URL DUMP_DIR MODEL LAYERS  one short and one long (chunked) prompt through the
                               connector: the dumps hsq reads back against a float32
                               transformers forward (hsq.closeness.rule's tolerance)
outputs REDIS RUN OUT MODEL DATA LAYERS N
                               N of a run's stored samples against the same forward
capacity URL N K [--rid]       N completions, K in flight: tokens/s (with --rid each
                               request carries an hsq rid, so the connector dumps it)
"""

from __future__ import annotations

import argparse
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


def capacity(url: str, n: int, k: int, rid: bool, label: str) -> int:
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("tiny").add_argument("dir", type=Path)
    o = sub.add_parser("one")
    for a in ("url", "dump_dir", "model", "layers"):
        o.add_argument(a)
    w = sub.add_parser("outputs")
    for a in ("redis_url", "run", "out", "model", "data", "layers", "n"):
        w.add_argument(a)
    c = sub.add_parser("capacity")
    for a in ("url", "n", "k", "label"):
        c.add_argument(a)
    c.add_argument("--rid", action="store_true")
    a = p.parse_args()
    if a.cmd == "tiny":
        tiny(a.dir)
        return 0
    if a.cmd == "one":
        return one(a.url, Path(a.dump_dir), a.model, [int(i) for i in a.layers.split(",")])
    if a.cmd == "outputs":
        layers = [int(i) for i in a.layers.split(",")]
        return outputs(a.redis_url, a.run, Path(a.out), a.model, Path(a.data), layers, int(a.n))
    return capacity(a.url, int(a.n), int(a.k), a.rid, a.label)


if __name__ == "__main__":
    sys.exit(main())
