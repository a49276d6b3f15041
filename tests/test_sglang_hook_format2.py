"""The SGLang hook's format 2 paths on a CPU: the pre-norm final state (its norm tap in the
glue, the refusals) and fp8 dumps quantized by the hook, with the synthetic batches and
stand-ins of tests/test_sglang_hook.py; every dump read back and compared."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hsq.dump.ready import READY_FILE, read_ready
from hsq.engines.sglang import plugin
from hsq.engines.sglang.config import HookConfig
from hsq.engines.sglang.launch_args import launch_command
from hsq.engines.sglang.layers import find_final_norm
from hsq.errors import ConfigError
from hsq.states import AUX_TENSOR, LAST_TENSOR, PRENORM_TENSOR
from tests.support.fakesglang import FakeRunner, H, Server, make_server, use_plugin


@pytest.mark.parametrize("encoding", ["plain", "fp8-e4m3"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed-aux", "aux-list"])
def test_prenorm_and_fp8_dumps_over_chunks_and_batches(
    tmp_path: Path, encoding: str, packed: bool
) -> None:
    """SGLANG_HS_PRENORM=1 and SGLANG_HS_DUMP_ENCODING: each dump holds the pre-norm state
    (and with fp8, values and scales exactly as hsq.quant.quantize makes them from the
    whole prompt, although the hook quantized chunk by chunk), read back and compared."""
    srv = make_server(tmp_path, prenorm=True, encoding=encoding)
    try:
        long, a, b = srv.add("hsq-long", 11), srv.add("hsq-a", 5), srv.add("hsq-b", 1)
        assert srv.forward([(long, 0, 4), (a, 0, 5)], packed=packed)
        assert srv.forward([(a, 5, 1), (long, 4, 4), (b, 0, 1)], packed=packed, pad=6)
        assert srv.forward([(long, 8, 3)], packed=packed)
        dumps = srv.dumps()  # each compared with its states inside
        assert sorted(dumps) == ["hsq-a", "hsq-b", "hsq-long"]
        meta = dumps["hsq-long"].meta
        assert meta.format_version == 2 and meta.num_tokens == 11
        assert meta.tensors[PRENORM_TENSOR] == [11, H]
        if encoding == "fp8-e4m3":
            assert meta.dtype == "bfloat16"  # what the states were quantized from
            assert dumps["hsq-long"].tensors[AUX_TENSOR].dtype == torch.float8_e4m3fn
            assert meta.tensors[AUX_TENSOR + "_scale"] == [11, 3]
    finally:
        srv.hook.close()


def test_fp8_without_prenorm_has_no_prenorm_tensor(tmp_path: Path) -> None:
    srv = make_server(tmp_path, encoding="fp8-e4m3")
    try:
        a = srv.add("hsq-a", 7)
        assert srv.forward([(a, 0, 7)])
        dump = srv.dumps()["hsq-a"]
        assert sorted(dump.tensors) == sorted(
            [AUX_TENSOR, AUX_TENSOR + "_scale", LAST_TENSOR, LAST_TENSOR + "_scale"]
        )
        assert dump.meta.format_version == 2 and not dump.meta.prenorm
    finally:
        srv.hook.close()


def test_plain_dumps_stay_format_1(tmp_path: Path) -> None:
    """Without the new options a dump is byte-for-byte the old format: a worker that reads
    only format 1 keeps working with this hook."""
    srv = make_server(tmp_path)
    try:
        a = srv.add("hsq-a", 3)
        assert srv.forward([(a, 0, 3)])
        dump = srv.dumps()["hsq-a"]
    finally:
        srv.hook.close()
    raw = (dump.path / "meta.json").read_text()
    assert dump.meta.format_version == 1 and '"encoding"' not in raw and '"prenorm"' not in raw


def test_missing_or_misshapen_prenorm_is_not_captured(tmp_path: Path) -> None:
    srv = make_server(tmp_path, prenorm=True)
    try:
        a = srv.add("hsq-a", 4)
        plan = srv.hook.plan([a], [0], [4])
        assert plan is not None
        s = srv.states["hsq-a"]
        ids = torch.tensor(s.ids)
        assert not srv.hook.capture(plan, ids, s.last, s.aux)  # the norm's tap did not fire
        assert not srv.hook.capture(plan, ids, s.last, s.aux, s.pre[:2])  # too few rows
        assert not srv.hook.capture(plan, ids, s.last, s.aux, s.aux)  # not [T, H]
        assert srv.dumps() == {} and srv.hook.skipped_batches == 3
        # A float32 residual (SGLang's fp32_residual) is dumped in the states' dtype.
        assert srv.hook.capture(plan, ids, s.last, s.aux, s.pre.float())
        assert list(srv.dumps()) == ["hsq-a"]
    finally:
        srv.hook.close()


class FusedAddNorm(torch.nn.Module):
    """SGLang's RMSNorm as the final norm calls it: with a residual, the fused kernel
    writes hidden + residual into `residual` and the normalized value into `x` (in
    place), and returns both; without one it is out of place."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return x * 0.5
        residual.add_(x)
        x.copy_(residual * 0.5)
        return x, residual


def prenorm_runner(tmp_path: Path, arch: str = "KimiK25ForConditionalGeneration") -> FakeRunner:
    runner = FakeRunner.kimi(tmp_path)
    runner.model.language_model.model.norm = FusedAddNorm()
    runner.model_config.hf_config.architectures = [arch]
    return runner


@pytest.mark.parametrize("with_residual", [True, False], ids=["fused-add", "no-residual"])
def test_plugin_taps_the_final_norm_for_the_prenorm_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_residual: bool
) -> None:
    """The glue end to end: the load hook registers the norm tap and announces prenorm in
    the marker; in a planned prefill the tap keeps the norm's input (the residual sum the
    fused kernel returns), the logits call hands it to the DumpHook; decode forwards
    and forwards without a plan leave nothing behind."""
    dump_dir = use_plugin(monkeypatch, tmp_path)
    monkeypatch.setenv("SGLANG_HS_PRENORM", "1")
    runner = prenorm_runner(tmp_path)
    plugin.around_load_model(runner.load, runner)
    hook = plugin._hook
    assert hook is not None
    try:
        marker = read_ready(dump_dir)
        assert marker is not None and marker.prenorm and marker.format_version == 2
        srv = Server(hook, dump_dir)
        a, b = srv.add("hsq-a", 3), srv.add("hsq-b", 5)
        s_a, s_b = srv.states["hsq-a"], srv.states["hsq-b"]
        pre = torch.cat([s_a.pre, s_b.pre])
        norm = runner.model.language_model.model.norm

        def run_batch(_sched: object, _batch: object) -> object:
            if with_residual:  # the model's last layer leaves (hidden, residual), sum = pre
                residual = (pre.float() * 0.25).to(torch.bfloat16)
                normed, _ = norm((pre - residual).clone(), residual.clone())
            else:
                normed = norm(pre.clone())
            assert isinstance(normed, torch.Tensor)
            hidden = torch.cat([s_a.last, s_b.last])  # what the test compares the dump with
            aux = torch.cat([s_a.aux, s_b.aux])
            ids = torch.tensor(s_a.ids + s_b.ids)
            return plugin.around_logits(lambda *_a, **_k: "x", None, ids, hidden, None, None, aux)

        if with_residual:  # the sum the kernel forms is what the dump must hold
            residual = (pre.float() * 0.25).to(torch.bfloat16)
            summed = (pre - residual) + residual
            srv.states["hsq-a"].pre, srv.states["hsq-b"].pre = summed[:3], summed[3:]
        batch = SimpleNamespace(
            reqs=[a, b],
            prefix_lens=[0, 0],
            extend_lens=[3, 5],
            forward_mode=SimpleNamespace(name="EXTEND"),
        )
        assert plugin.around_run_batch(run_batch, None, batch) == "x"
        assert sorted(srv.dumps()) == ["hsq-a", "hsq-b"]
        norm(pre.clone())  # outside a planned prefill (decode, CUDA-graph capture): ignored
        assert getattr(plugin._prenorm, "value", None) is None
    finally:
        hook.close()


def test_prenorm_is_refused_for_a_family_hsq_has_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_plugin(monkeypatch, tmp_path)
    monkeypatch.setenv("SGLANG_HS_PRENORM", "1")
    runner = prenorm_runner(tmp_path, arch="Gemma3ForCausalLM")
    with pytest.raises(ConfigError, match="pre-norm final state is captured only") as err:
        plugin.around_load_model(runner.load, runner)
    assert "Gemma3ForCausalLM" in str(err.value) and runner.loads == 0


def test_prenorm_is_refused_when_the_model_has_no_final_norm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_plugin(monkeypatch, tmp_path)
    monkeypatch.setenv("SGLANG_HS_PRENORM", "1")
    runner = FakeRunner.kimi(tmp_path)  # a stand-in model without a norm module
    with pytest.raises(ConfigError, match="no final norm"):
        plugin.around_load_model(runner.load, runner)
    assert not (tmp_path / "dumps" / READY_FILE).exists()


def test_find_final_norm() -> None:
    norm = FusedAddNorm()
    assert find_final_norm(SimpleNamespace(model=SimpleNamespace(norm=norm))) is norm
    kimi = SimpleNamespace(language_model=SimpleNamespace(model=SimpleNamespace(norm=norm)))
    assert find_final_norm(kimi) is norm
    assert find_final_norm(SimpleNamespace(model=SimpleNamespace(norm=None))) is None


def test_encoding_and_prenorm_from_env() -> None:
    env = {
        "SGLANG_HS_DUMP_DIR": "/d",
        "SGLANG_HS_DUMP_ENCODING": "fp8-e4m3",
        "SGLANG_HS_PRENORM": "1",
    }
    cfg = HookConfig.from_env(env)
    assert cfg is not None and cfg.encoding == "fp8-e4m3" and cfg.prenorm
    assert HookConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(ValueError, match="SGLANG_HS_DUMP_ENCODING"):
        HookConfig.from_env({**env, "SGLANG_HS_DUMP_ENCODING": "fp8"})
    with pytest.raises(ValueError, match="SGLANG_HS_PRENORM"):
        HookConfig.from_env({**env, "SGLANG_HS_PRENORM": "maybe"})
    cmd = launch_command("m", "/d", sglang_version="0.5.23", encoding="fp8-e4m3", prenorm=True)
    assert "SGLANG_HS_DUMP_ENCODING=fp8-e4m3" in cmd and "SGLANG_HS_PRENORM=1" in cmd


def test_device_staging_dumps_the_same_states(tmp_path: Path) -> None:
    """SGLANG_HS_DEVICE_STAGING=1: rows cloned on the device before the host copy; the
    dumps are the same (on the GPU the next forward then need not wait for the copy)."""
    srv = make_server(tmp_path, device_staging=True)
    try:
        long, a = srv.add("hsq-long", 9), srv.add("hsq-a", 4)
        assert srv.forward([(long, 0, 5), (a, 0, 4)], packed=False)
        assert srv.forward([(long, 5, 4)], packed=False, pad=3)
        assert sorted(srv.dumps()) == ["hsq-a", "hsq-long"]
    finally:
        srv.hook.close()
    assert HookConfig.from_env(
        {"SGLANG_HS_DUMP_DIR": "/d", "SGLANG_HS_DEVICE_STAGING": "1"}
    ) == HookConfig(Path("/d"), device_staging=True)
