"""hsq's connector inside vLLM's real classes, on a CPU: skipped unless vLLM imports.

CI's venv has no vLLM, so this runs where one is installed (on this project's CPU machine:
vLLM 0.26.0 --no-deps with torch 2.13 CPU, docs/vllm.md). It builds a real VllmConfig
with hsq's flags, has vLLM's KVConnectorFactory load HsqConnector through
kv_connector_module_path, drives the scheduler side with real Request/SchedulerOutput
objects, and the worker side from the pending save that crossed (pickled) to the writer.
What needs a GPU (register_kv_caches' TP group, the CUDA copy in _submit_async_write)
is replaced by its CPU equivalent and marked so below."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from hsq.dump.find import scan_by_rid  # noqa: E402
from hsq.dump.format import fingerprint  # noqa: E402
from hsq.dump.read import Expected, read_dump  # noqa: E402
from hsq.dump.ready import read_ready  # noqa: E402
from hsq.engines.vllm import connector as shim  # noqa: E402
from hsq.engines.vllm.config import ConnectorConfig  # noqa: E402
from hsq.engines.vllm.launch_args import CONNECTOR_CLASS, CONNECTOR_MODULE  # noqa: E402
from hsq.engines.vllm.layers import vllm_aux_ids  # noqa: E402
from hsq.errors import ConfigError  # noqa: E402

L, H, LAYERS = 4, 256, (2, 1)


def tiny_llama(tmp_path: Path) -> Path:
    from transformers import LlamaConfig

    model = tmp_path / "tinyllama"
    LlamaConfig(  # type: ignore[call-arg,unused-ignore]
        hidden_size=H,
        intermediate_size=512,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=2048,
        torch_dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(model)
    save_file(
        {"model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}, model / "model.safetensors"
    )
    return model


def vllm_config(model: Path, dump: Path, *, prefix_caching: bool = False, ids: Any = None) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    mc = ModelConfig(
        model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048
    )
    sc = SpeculativeConfig(
        method="extract_hidden_states",
        num_speculative_tokens=1,
        draft_model_config={
            "hf_config": {"eagle_aux_hidden_state_layer_ids": ids or vllm_aux_ids(LAYERS, L)}
        },
        target_model_config=mc,
        target_parallel_config=ParallelConfig(),
    )
    kv = KVTransferConfig(
        kv_connector=CONNECTOR_CLASS,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_producer",
        kv_connector_extra_config=ConnectorConfig(dump, LAYERS, prenorm=True).to_extra(),
    )
    return VllmConfig(
        model_config=mc,
        speculative_config=sc,
        kv_transfer_config=kv,
        cache_config=CacheConfig(enable_prefix_caching=prefix_caching),
        device_config=DeviceConfig(device="cpu"),
    )


def connector(config: Any, role: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorFactory.create_connector(config, getattr(KVConnectorRole, role), None)


def request(req_id: str, ids: list[int], params: dict[str, Any] | None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=1, extra_args=extra)
    return Request(request_id=req_id, prompt_token_ids=ids, sampling_params=sp, pooling_params=None)


def schedule(conn: Any, *reqs: Any) -> Any:
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [NewRequestData.from_request(r, ([0],)) for r in reqs]
    return conn.build_connector_meta(so)


class Event:
    def synchronize(self) -> None:
        pass


def test_vllm_loads_the_connector_and_a_request_becomes_an_hsq_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, dump = tiny_llama(tmp_path), tmp_path / "dump"
    config = vllm_config(model, dump)
    sched = connector(config, "SCHEDULER")
    assert type(sched).__name__ == CONNECTOR_CLASS and sched.use_lock is False
    ours = request("cmpl-hsq-3-a0-00-0-abcdef12", [5, 6, 7], {"hsq_rid": "hsq-3-a0-00"})
    warmup = request("cmpl-warmup-0-12345678", [1, 2], None)
    cut = request("cmpl-hsq-4-a0-00-0-abcdef12", [5, 6, 7, 8], {"hsq_rid": "hsq-4-a0-00"})
    schedule(sched, ours, warmup, cut)
    from vllm.v1.request import RequestStatus

    for r in (ours, warmup, cut):  # as the engine leaves them: prefill done, one token out
        r.num_computed_tokens = len(r.prompt_token_ids)
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    cut.num_computed_tokens, cut.status = 2, RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(cut, [2]) == (False, None)  # aborted mid-prefill
    assert sched.request_finished(ours, [0]) == (True, {"hsq_rid": "hsq-3-a0-00"})
    assert sched.request_finished(warmup, [1]) == (False, None)  # never copied, never dumped
    meta = pickle.loads(pickle.dumps(schedule(sched)))  # to the worker (multiproc executors)
    [pending] = meta.pending_saves
    assert isinstance(pending, shim.HsqPendingSave) and pending.hsq_rid == "hsq-3-a0-00"

    # Worker side. On a GPU, distributed init gives the TP rank and register_kv_caches
    # starts the writer; here the rank is 0 by hand and the writer started directly.
    monkeypatch.setattr(shim, "_tp_rank", lambda: 0)
    worker = connector(config, "WORKER")
    worker._hsq.start_writer(vllm.__version__)
    assert read_ready(dump) is not None
    hidden = torch.randn(3, 3, H).to(torch.bfloat16)

    def cpu_submit(self: Any, p: Any) -> None:  # the base's CUDA extract + D2H, on a CPU
        self._write_tensors(
            {"hidden_states": hidden, "token_ids": p.token_ids}, Event(), p.filename, None
        )

    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector as base,
    )

    monkeypatch.setattr(base, "_submit_async_write", cpu_submit)
    worker.bind_connector_metadata(meta)
    worker.get_finished({pending.req_id})
    [found] = scan_by_rid(dump).complete["hsq-3-a0-00"]
    exp = Expected(
        rid="hsq-3-a0-00",
        input_fingerprint=fingerprint([5, 6, 7]),
        num_tokens=3,
        layer_ids=list(LAYERS),
        hidden_size=H,
        dtype="bfloat16",
        prenorm=True,
    )
    got = read_dump(found.path, exp)
    assert torch.equal(got.aux_hidden_states, torch.cat([hidden[:, 1], hidden[:, 0]], 1))


def test_vllm_settings_that_give_wrong_dumps_stop_the_connector(tmp_path: Path) -> None:
    model, dump = tiny_llama(tmp_path), tmp_path / "dump"
    with pytest.raises(ConfigError, match="prefix caching"):
        connector(vllm_config(model, dump, prefix_caching=True), "SCHEDULER")
    with pytest.raises(ConfigError, match="need exactly"):
        connector(vllm_config(model, dump, ids=[1, 2, 3]), "SCHEDULER")


def test_the_launch_flags_parse_in_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's engine-argument parser takes the command hsq launch-vllm builds (the three
    API-server flags are added by hand: the serving stack, FastAPI, is not installed
    where this runs). No GPU here: the CUDA wheel's platform detection finds none, so it
    parses as the CPU platform."""
    import vllm.platforms as platforms
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from hsq.engines.vllm.launch_args import launch_command

    monkeypatch.setattr(platforms, "_current_platform", CpuPlatform())
    cmd = launch_command(str(tiny_llama(tmp_path)), tmp_path / "d", LAYERS, L)
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.add_argument("model_tag")
    parser.add_argument("--host")
    parser.add_argument("--port")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true")
    args = parser.parse_args(cmd[cmd.index("serve") + 1 :])
    assert args.enable_prefix_caching is False and args.enable_prompt_tokens_details
    assert args.speculative_config["method"] == "extract_hidden_states"
    assert args.kv_transfer_config.kv_connector_module_path == CONNECTOR_MODULE
