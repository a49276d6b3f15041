"""Dump format 2 with real processes: fp8 dumps quantized by the server, and the pre-norm
final state, from a real reference server through a real worker and a real redis-server
into outputs that are compared with a transformers forward of the same weights."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import hsq as hsq_pkg
from hsq import quant
from hsq.data import HiddenStateDataset, collate
from hsq.dump.ready import ReadyMarker, read_ready, write_ready
from hsq.engines.reference.model import HiddenStateModel, load_model
from hsq.outputs.format import open_output
from hsq.producer.synthetic import write_synthetic
from hsq.states import AUX_TENSOR, FP8, LAST_TENSOR, PRENORM_TENSOR
from tests.helpers import enqueue, hsq, start_worker, store
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]


@functools.cache
def tiny() -> HiddenStateModel:
    torch.set_num_threads(2)  # as the servers run (bit-identical float32 results)
    return load_model(
        "tiny", device="cpu", dtype=torch.float32, dump_dtype=torch.bfloat16, layers=None
    )


def hf_states(ids: list[int]) -> dict[str, torch.Tensor]:
    """The states straight from transformers, no hsq code in between: HF hidden_states[i]
    for the aux layers [2, 4, 5] (tiny: L=8), hidden_states[-1] (post-norm), and the last
    decoder layer's output (what the final norm normalizes), each cast to bf16 as dumped."""
    decoder = tiny().decoder
    seen: dict[str, torch.Tensor] = {}
    layers = decoder.get_submodule("layers")
    assert isinstance(layers, torch.nn.ModuleList)
    hook = layers[-1].register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("pre", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.inference_mode():
            out = decoder(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    finally:
        hook.remove()
    hs = out.hidden_states
    return {
        AUX_TENSOR: torch.cat([hs[i][0] for i in (2, 4, 5)], dim=-1).to(torch.bfloat16),
        LAST_TENSOR: hs[-1][0].to(torch.bfloat16),
        PRENORM_TENSOR: seen["pre"][0].to(torch.bfloat16),
    }


def run_burst(
    tmp_path: Path, srv: ReferenceServer, redis_url: str, run: str, n: int, *enq: str
) -> tuple[Path, list[dict[str, Any]]]:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, n, seed=11, min_len=3, max_len=200)
    out = tmp_path / "out"
    enqueue(ds, run, out, redis_url, "--chunk-size", "4", *enq)
    w = start_worker(tmp_path, run, srv, redis_url, "--burst")
    assert w.proc.wait(120) == 0, w.log_tail()
    st = store(redis_url, run)
    assert st.count(st.keys.done) == n and st.count(st.keys.dead) == 0
    return out / run, [json.loads(line) for line in ds.read_text().splitlines()]


def test_fp8_dumps_with_prenorm_end_to_end(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    """The server quantizes on its device (here the CPU) and writes the pre-norm state;
    the worker only validates and copies: every stored byte is hsq.quant.quantize of the
    transformers states (the worker's own quantizer would give the same), verify --deep
    passes, and the readers dequantize all three states."""
    srv = server_factory("--dump-encoding", FP8, "--prenorm", name="fp8pre").wait_ready()
    marker = read_ready(srv.dump_dir)
    assert marker is not None and marker.encoding == FP8 and marker.prenorm
    root, samples = run_burst(
        tmp_path, srv, redis_url, "fp8pre", 8, "--store-dtype", FP8, "--prenorm"
    )
    st = store(redis_url, "fp8pre")
    for sample in samples:
        entry = st.get_manifest(sample["id"])
        assert entry is not None and entry.store_dtype == FP8
        raw = open_output(root / entry.path, raw=True)
        want = hf_states(sample["input_ids"])
        stored = {
            AUX_TENSOR: raw.aux_hidden_states,
            LAST_TENSOR: raw.last_hidden_state,
            PRENORM_TENSOR: raw.last_hidden_state_prenorm,
        }
        for name, groups in ((AUX_TENSOR, 3), (LAST_TENSOR, 1), (PRENORM_TENSOR, 1)):
            q, scale = quant.quantize(want[name], groups)
            assert torch.equal(stored[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(raw.scales[name + "_scale"], scale), name
        deq = open_output(root / entry.path)
        assert deq.last_hidden_state_prenorm.dtype == torch.bfloat16
        assert torch.equal(
            deq.last_hidden_state_prenorm,
            quant.dequantize(*quant.quantize(want[PRENORM_TENSOR], 1)),
        )
    proc = hsq("verify", "--run", "fp8pre", "--redis", redis_url, "--deep", check=True)
    assert "ok 8" in proc.stdout


def test_prenorm_bf16_run_equals_the_transformers_forward(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    srv = server_factory("--prenorm", name="pre").wait_ready()
    root, samples = run_burst(tmp_path, srv, redis_url, "pre", 6, "--prenorm")
    st = store(redis_url, "pre")
    assert st.require_config().prenorm
    for sample in samples:
        entry = st.get_manifest(sample["id"])
        assert entry is not None
        got = open_output(root / entry.path)
        want = hf_states(sample["input_ids"])
        # One request per forward on the CPU: bit for bit (docs/reference-server.md).
        assert torch.equal(got.aux_hidden_states, want[AUX_TENSOR])
        assert torch.equal(got.last_hidden_state, want[LAST_TENSOR])
        assert torch.equal(got.last_hidden_state_prenorm, want[PRENORM_TENSOR])
        assert not torch.equal(got.last_hidden_state_prenorm, got.last_hidden_state)
    ds = HiddenStateDataset(root)
    batch = collate([ds[0], ds[1]])
    assert batch["last_hidden_state_prenorm"].shape == batch["last_hidden_state"].shape
    assert "ok 6" in hsq("verify", "--run", "pre", "--redis", redis_url, "--deep").stdout
    # A second enqueue keeps the run's choice; asking for the other one is refused.
    enqueue(tmp_path / "data.jsonl", "pre", tmp_path / "out", redis_url)
    assert st.require_config().prenorm
    bad = hsq(
        "enqueue",
        str(tmp_path / "data.jsonl"),
        "--run",
        "pre",
        "--out",
        str(tmp_path / "out"),
        "--redis",
        redis_url,
        "--no-progress",
        env={**os.environ, "HSQ_PRENORM": "0"},
    )
    assert bad.returncode == 2 and "prenorm: recorded True, given False" in bad.stderr


@pytest.mark.parametrize(
    ("server_args", "enq", "says"),
    [
        (("--dump-encoding", FP8), (), "quantized to fp8-e4m3 and the run stores bf16"),
        ((), ("--prenorm",), "does not capture it"),
    ],
    ids=["fp8-server-bf16-run", "prenorm-run-plain-server"],
)
def test_worker_refuses_a_server_whose_dumps_the_run_cannot_use(
    tmp_path: Path,
    server_factory: Factory,
    redis_url: str,
    server_args: tuple[str, ...],
    enq: tuple[str, ...],
    says: str,
) -> None:
    """At start-up, from the readiness marker: exit 2 with the reason, no sample touched."""
    srv = server_factory(*server_args, name="mismatch").wait_ready()
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 4, seed=3, min_len=4, max_len=16)
    enqueue(ds, "mm", tmp_path / "out", redis_url, *enq)
    w = start_worker(tmp_path, "mm", srv, redis_url, "--burst")
    assert w.proc.wait(60) == 2, w.log_tail()
    assert says in w.log_path.read_text()
    st = store(redis_url, "mm")
    assert st.count(st.keys.dead) == 0 and len(st.outstanding_samples()) == 4


def test_fp8_dumps_reaching_a_bf16_run_are_refused_per_sample(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    """Past the start-up check (here a marker that claims plain dumps, as a server
    restarted with other settings would leave), each fp8 dump is refused with
    meta_mismatch and nothing is written: a bf16 run never stores fp8 states."""
    srv = server_factory("--dump-encoding", FP8, "--no-ready-marker", name="liar").wait_ready()
    v = hsq_pkg.__version__
    marker = ReadyMarker((2, 4, 5), tiny().identity, "hsq-reference", v, v, srv.proc.pid, 0.0)
    assert marker.encoding == "plain"
    write_ready(srv.dump_dir, marker)
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 3, seed=4, min_len=4, max_len=16)
    enqueue(ds, "liar", tmp_path / "out", redis_url, "--max-attempts", "1")
    w = start_worker(tmp_path, "liar", srv, redis_url, "--burst")
    assert w.proc.wait(120) == 0, w.log_tail()
    st = store(redis_url, "liar")
    dead = st.dead_entries()
    assert len(dead) == 3 and st.count(st.keys.done) == 0
    assert {d["reason"] for d in dead.values()} == {"meta_mismatch"}
    assert all("--store-dtype fp8-e4m3" in d["message"] for d in dead.values())
    assert not list((tmp_path / "out").rglob("*.safetensors"))
