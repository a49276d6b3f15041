"""hsq's vLLM connector without vLLM: the pure core (hsq/engines/vllm/core.py and what it
uses) writes what ExampleHiddenStatesConnector hands ``_write_tensors`` (``hidden_states``
[T, k, H] in ascending layer-id order, ``token_ids`` [T]) as hsq dumps, and hsq's own
reader (scan_by_rid, read_dump, check_meta) takes them. The post-norm state is checked
against transformers' LlamaRMSNorm, an implementation independent of ours. The shim over
vLLM's real class is tests/test_vllm_real.py (skipped where vLLM does not import)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hsq.dump.find import scan_by_rid
from hsq.dump.format import fingerprint
from hsq.dump.read import Expected, check_meta, read_dump
from hsq.dump.ready import read_ready
from hsq.engines.common import model_identity
from hsq.engines.vllm.checkpoint import read_final_norm
from hsq.engines.vllm.config import ConnectorConfig
from hsq.engines.vllm.core import ConnectorCore, rid_of
from hsq.engines.vllm.layers import aux_rows, vllm_aux_ids
from hsq.engines.vllm.refusals import ServingFacts
from hsq.errors import ConfigError
from hsq.quant import dequantize, quantize
from hsq.states import AUX_TENSOR, FP8, LAST_TENSOR, PRENORM_TENSOR, scale_name

L, H = 4, 16


class Event:
    """vLLM passes a torch.cuda.Event; the core only calls synchronize() on it."""

    def __init__(self) -> None:
        self.synced = 0

    def synchronize(self) -> None:
        self.synced += 1


def checkpoint(tmp_path: Path) -> Path:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": L,
        "hidden_size": H,
        "rms_norm_eps": 1e-5,
    }
    (model / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)
    save_file(
        {"model.norm.weight": weight, "lm_head.weight": torch.zeros(2, H)},
        model / "model.safetensors",
    )
    return model


def facts(**kw: object) -> ServingFacts:
    base: dict[str, object] = {
        "architecture": "LlamaForCausalLM",
        "num_layers": L,
        "hidden_size": H,
        "captured_ids": [1, 2, 4],
        "enable_prefix_caching": False,
        "cache_dtype": "auto",
    }
    return ServingFacts(**{**base, **kw})  # type: ignore[arg-type]


def make_core(tmp_path: Path, **cfg: object) -> tuple[ConnectorCore, Path]:
    model = checkpoint(tmp_path)
    dump = tmp_path / "dump"
    extra = {"shared_storage_path": str(dump), "hsq_layer_ids": [2, 1], **cfg}
    config = ConnectorConfig.from_extra(extra)
    ident = model_identity(str(model), "LlamaForCausalLM", L, H, {"num_hidden_layers": L})
    return ConnectorCore(config, facts(), ident, str(model)), model


def rows(t: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, 3, H, generator=g).to(torch.bfloat16)


def reference_norm(model: Path, x: torch.Tensor) -> torch.Tensor:
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(H, eps=1e-5)
    norm.weight.data = load_file(model / "model.safetensors")["model.norm.weight"].float()
    norm = norm.to(torch.bfloat16)
    with torch.no_grad():
        out: torch.Tensor = norm(x)
    return out


def test_a_dump_is_what_hsq_reads_back(tmp_path: Path) -> None:
    core, model = make_core(tmp_path, hsq_prenorm=True)
    core.start_writer("0.26.0")
    marker = read_ready(core.cfg.dump_dir)
    assert marker is not None and marker.server == "vllm" and marker.prenorm
    assert list(marker.layer_ids) == [2, 1] and marker.model == core.model
    ids = torch.tensor([5, 9, 2, 7, 7], dtype=torch.int64)
    hidden = rows(5)
    ev = Event()
    core.remember("/d/cmpl-x.safetensors", "hsq-7-a0-deadbeef")
    path = core.write_tensors(
        {"hidden_states": hidden, "token_ids": ids}, ev, "/d/cmpl-x.safetensors"
    )
    assert path is not None and ev.synced == 1
    found = scan_by_rid(core.cfg.dump_dir)
    assert list(found.complete) == ["hsq-7-a0-deadbeef"] and not found.writing
    exp = Expected(
        rid="hsq-7-a0-deadbeef",
        input_fingerprint=fingerprint([5, 9, 2, 7, 7]),
        num_tokens=5,
        layer_ids=[2, 1],
        hidden_size=H,
        dtype="bfloat16",
        model_id=core.model.model_id,
        prenorm=True,
    )
    dump = read_dump(path, exp)
    check_meta(dump.meta, exp)
    # aux in the run's order: id 2 (row 1 of vLLM's ascending 1, 2, 4), then id 1 (row 0)
    assert torch.equal(dump.aux_hidden_states, torch.cat([hidden[:, 1], hidden[:, 0]], dim=1))
    assert torch.equal(dump.tensors[PRENORM_TENSOR], hidden[:, 2])
    assert torch.equal(dump.last_hidden_state, reference_norm(model, hidden[:, 2]))


def test_requests_without_an_hsq_rid_are_not_dumped(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path)
    core.start_writer("0.26.0")
    ev = Event()
    out = core.write_tensors({"hidden_states": rows(3), "token_ids": torch.arange(3)}, ev, "k")
    assert out is None and ev.synced == 1  # the event is still waited on (pinned memory)
    assert not [p for p in core.cfg.dump_dir.iterdir() if p.name.startswith("req_")]
    assert rid_of(None) is None and rid_of({}) is None
    assert rid_of({"hsq_rid": "hsq-1-a0-00"}) == "hsq-1-a0-00"
    assert rid_of({"hsq_rid": "../../etc"}) is None and rid_of({"hsq_rid": 3}) is None


def test_wrong_rows_are_not_written(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path)
    writer = core.start_writer("0.26.0")
    core.remember("k", "hsq-1-a0-00")
    bad = torch.zeros(4, 2, H, dtype=torch.bfloat16)  # two layers, three captured
    assert (
        core.write_tensors({"hidden_states": bad, "token_ids": torch.arange(4)}, Event(), "k")
        is None
    )
    core.remember("k2", "hsq-1-a1-00")
    short = rows(3)
    assert (
        core.write_tensors({"hidden_states": short, "token_ids": torch.arange(4)}, Event(), "k2")
        is None
    )
    assert writer.errors == 2


def test_fp8_dumps_are_what_the_worker_would_have_quantized(tmp_path: Path) -> None:
    core, model = make_core(tmp_path, hsq_dump_encoding=FP8)
    core.start_writer("0.26.0")
    hidden = rows(6, seed=3)
    core.remember("k", "hsq-2-a0-00")
    path = core.write_tensors({"hidden_states": hidden, "token_ids": torch.arange(6)}, Event(), "k")
    assert path is not None
    exp = Expected(
        rid="hsq-2-a0-00",
        input_fingerprint=fingerprint(list(range(6))),
        num_tokens=6,
        store_dtype=FP8,
    )
    dump = read_dump(path, exp)
    assert dump.meta.encoding == FP8 and dump.meta.dtype == "bfloat16"
    aux = torch.cat([hidden[:, 1], hidden[:, 0]], dim=1)
    q, scale = quantize(aux, 2)
    assert torch.equal(dump.tensors[AUX_TENSOR].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dump.tensors[scale_name(AUX_TENSOR)], scale)
    last = dequantize(
        dump.tensors[LAST_TENSOR], dump.tensors[scale_name(LAST_TENSOR)], torch.float32
    )
    ref = reference_norm(model, hidden[:, 2]).float()
    assert torch.allclose(last, ref, rtol=0.07, atol=1e-3)


def test_writer_threads_take_distinct_indices_and_a_restart_goes_past_them(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path, hsq_fsync=False)
    core.start_writer("0.26.0")
    rids = [f"hsq-{i}-a0-00" for i in range(8)]
    for r in rids:
        core.remember(r, r)
    threads = [
        threading.Thread(
            target=core.write_tensors,
            args=({"hidden_states": rows(2, i), "token_ids": torch.arange(2)}, Event(), r),
        )
        for i, r in enumerate(rids)
    ]  # vLLM's writer pool: 8 threads by default
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    found = scan_by_rid(core.cfg.dump_dir)
    assert sorted(found.complete) == sorted(rids)
    again = ConnectorCore(core.cfg, core.facts, core.model, core.model_path)
    writer = again.start_writer("0.26.0")
    again.remember("k", "hsq-9-a0-00")
    path = again.write_tensors(
        {"hidden_states": rows(2), "token_ids": torch.arange(2)}, Event(), "k"
    )
    assert path is not None and path.name == "req_8" and writer.errors == 0


def test_the_norm_weight_comes_from_a_sharded_checkpoint(tmp_path: Path) -> None:
    model = checkpoint(tmp_path)
    (model / "model.safetensors").rename(model / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert list(read_final_norm(model, H).weight.shape) == [H]
    with pytest.raises(ConfigError, match="expected"):
        read_final_norm(model, H + 1)
    with pytest.raises(ConfigError, match="not a local checkpoint"):
        read_final_norm(tmp_path / "hub-id", H)


def test_layer_ids_map_back_to_the_runs_order() -> None:
    assert vllm_aux_ids([29, 2, 16], 32) == [2, 16, 29, 32]
    assert vllm_aux_ids([2, 2], 4) == [2, 4]
    assert aux_rows([29, 2, 16], [2, 16, 29, 32]) == [2, 0, 1]


REFUSED = [
    ({"enable_prefix_caching": True}, "prefix caching"),
    ({"cache_dtype": "fp8_e4m3"}, "kv-cache-dtype fp8_e4m3"),
    ({"captured_ids": [1, 2]}, "need exactly \\[1, 2, 4\\]"),
    ({"captured_ids": [2, 1, 4]}, "need exactly"),
    ({"pipeline_parallel_size": 2}, "pipeline"),
    ({"data_parallel_size": 2}, "data parallel"),
    ({"context_parallel_size": 2}, "context parallel"),
    ({"tensor_parallel_size": 2, "rank_zero_writes": False}, "rank 0"),
    ({"architecture": "GemmaForCausalLM"}, "not a model family"),
    ({"num_layers": 2, "captured_ids": [1, 2]}, "past the model"),
]


@pytest.mark.parametrize(("change", "match"), REFUSED)
def test_refusals_at_start(tmp_path: Path, change: dict[str, object], match: str) -> None:
    cfg = ConnectorConfig.from_extra(
        {"shared_storage_path": str(tmp_path), "hsq_layer_ids": [2, 1]}
    )
    ident = model_identity("m", "LlamaForCausalLM", L, H, {})
    with pytest.raises(ConfigError, match=match):
        ConnectorCore(cfg, facts(**change), ident, "m")


def test_tp_with_rank_zero_writing_and_deepseek_id_zero(tmp_path: Path) -> None:
    ident = model_identity("m", "DeepseekV3ForCausalLM", L, H, {})
    cfg = ConnectorConfig.from_extra({"shared_storage_path": str(tmp_path), "hsq_layer_ids": [1]})
    ConnectorCore(
        cfg,
        facts(tensor_parallel_size=8, captured_ids=[1, 4], architecture="DeepseekV3ForCausalLM"),
        ident,
        "m",
    )
    zero = ConnectorConfig.from_extra({"shared_storage_path": str(tmp_path), "hsq_layer_ids": [0]})
    with pytest.raises(ConfigError, match="layer id 0"):
        ConnectorCore(
            zero, facts(captured_ids=[0, 4], architecture="DeepseekV3ForCausalLM"), ident, "m"
        )


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "shared_storage_path"),
        ({"shared_storage_path": "/d"}, "hsq_layer_ids"),
        ({"shared_storage_path": "/d", "hsq_layer_ids": [1, 1]}, "repeats"),
        ({"shared_storage_path": "/d", "hsq_layer_ids": [1], "hsq_layers": [1]}, "unknown"),
        (
            {"shared_storage_path": "/d", "hsq_layer_ids": [1], "hsq_prenorm": "yes"},
            "true or false",
        ),
        (
            {"shared_storage_path": "/d", "hsq_layer_ids": [1], "hsq_dump_encoding": "int4"},
            "encoding",
        ),
    ],
)
def test_bad_settings_are_refused(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConnectorConfig.from_extra(extra)


def test_settings_round_trip() -> None:
    cfg = ConnectorConfig(
        Path("/d"), (3, 1), encoding=FP8, prenorm=True, fsync=False, model_path="/m"
    )
    extra = cfg.to_extra()
    assert extra["use_synchronization_lock"] is False
    assert ConnectorConfig.from_extra(extra) == cfg


def test_a_request_whose_prompt_was_not_all_computed_is_not_dumped() -> None:
    from hsq.engines.vllm.core import prompt_computed

    assert prompt_computed(5, 6, "RequestStatus.FINISHED_LENGTH_CAPPED")
    assert prompt_computed(5, 5, "RequestStatus.FINISHED_LENGTH_CAPPED")
    assert not prompt_computed(5, 3, "RequestStatus.FINISHED_LENGTH_CAPPED")
    assert not prompt_computed(5, 5, "RequestStatus.FINISHED_ABORTED")
    assert not prompt_computed(0, 0, "RequestStatus.FINISHED_LENGTH_CAPPED")
