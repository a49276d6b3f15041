"""`hsq worker --engine vllm` end to end with real processes: a real redis-server, a
real worker, real HTTP to a vLLM-shaped server (tests.support.fakevllm: vLLM's completions
API and capture rule over a transformers forward, not vLLM itself) whose dumps hsq's real
connector core writes after answering. The stored states are compared with a transformers
forward done here, the post-norm state included (HF's own final norm against the
connector's, applied to the pre-norm row)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hsq.closeness.rule import closeness
from hsq.node.procs import ManagedProcess
from hsq.outputs.format import open_output
from hsq.producer.synthetic import write_synthetic
from tests.helpers import enqueue, hsq, spawn_worker, store
from tests.support.procs import FakeVllmServer
from tests.support.tinymodel import build

LAYERS = (4, 2, 5)  # tiny: L = 8; deliberately not ascending


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    model = build(tmp_path / "tiny")
    weights = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(5)  # a norm weight that is not all ones
    weights["model.norm.weight"] = 1 + 0.3 * torch.randn(
        weights["model.norm.weight"].shape, generator=g
    )
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.fixture
def server(tmp_path: Path, checkpoint: Path) -> Iterator[FakeVllmServer]:
    layers = ",".join(map(str, LAYERS))
    srv = FakeVllmServer(
        tmp_path / "dumps",
        tmp_path / "vllm.log",
        args=["--model", str(checkpoint), "--layers", layers, "--prenorm"],
    )
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def start_worker(
    tmp_path: Path, run: str, srv: FakeVllmServer, redis_url: str, *extra: str
) -> ManagedProcess:
    log = tmp_path / f"worker-{run}.log"
    return spawn_worker(run, srv.url, srv.dump_dir, redis_url, log, "--name", "w", *extra)


def hf_states(model: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    with torch.inference_mode():
        hs = m.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i][0] for i in LAYERS], dim=-1).to(torch.bfloat16)
    return aux, hs[-1][0]


def test_a_run_through_the_vllm_client(
    tmp_path: Path, server: FakeVllmServer, redis_url: str, checkpoint: Path
) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 10, seed=3, min_len=3, max_len=120, vocab=1000)
    out = tmp_path / "out"
    layers = ",".join(map(str, LAYERS))
    enqueue(ds, "v", out, redis_url, "--chunk-size", "3", "--layers", layers, "--prenorm")
    w = start_worker(
        tmp_path, "v", server, redis_url, "--burst", "--engine", "vllm", "--inflight", "4"
    )
    assert w.proc.wait(180) == 0, w.log_tail()
    st = store(redis_url, "v")
    assert st.count(st.keys.done) == 10 and st.count(st.keys.dead) == 0
    for line in ds.read_text().splitlines()[:4]:
        sample = json.loads(line)
        entry = st.get_manifest(sample["id"])
        assert entry is not None
        got = open_output(out / "v" / entry.path)
        aux, last = hf_states(checkpoint, sample["input_ids"])
        assert torch.equal(got.aux_hidden_states, aux)  # one forward per request: exact
        c = closeness(got.last_hidden_state.float(), last)  # bf16 pre-norm, then the norm
        assert c.ok, c
    assert "ok 10" in hsq("verify", "--run", "v", "--redis", redis_url, "--deep").stdout

    # hsq audit speaks vLLM's API too: each sample re-extracted alone through the connector.
    audit = ["audit", "--run", "v", "--redis", redis_url, "--sample-fraction", "1", "--out",
             str(out), "--server", server.url, "--dump-dir", str(server.dump_dir)]  # fmt: skip
    wrong = hsq(*audit)  # SGLang's client: refused before any request
    assert wrong.returncode == 2 and "--engine vllm" in wrong.stderr, wrong.stderr
    res = hsq(*audit, "--engine", "vllm")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "audited         10 of 10" in res.stdout and "match           10" in res.stdout
    assert "mismatched      0" in res.stdout


def test_the_wrong_engine_is_refused_at_start(
    tmp_path: Path, server: FakeVllmServer, redis_url: str
) -> None:
    """SGLang's /generate does not exist on vLLM: a worker without --engine vllm
    reads the connector's marker and exits 2 before its first request, holding nothing."""
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 2, seed=1, min_len=3, max_len=20, vocab=1000)
    enqueue(ds, "s", tmp_path / "out", redis_url)
    w = start_worker(tmp_path, "s", server, redis_url, "--burst")
    assert w.proc.wait(180) == 2
    assert "--engine vllm" in w.log_tail()
    st = store(redis_url, "s")
    assert st.count(st.keys.done) == 0 and st.count(st.keys.dead) == 0
