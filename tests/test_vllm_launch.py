"""`hsq launch-vllm`: the command line it builds (hsq/engines/vllm/launch_args.py) and what
it refuses before vLLM starts. --print-only runs the real CLI; nothing starts vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hsq.cli.main import cli
from hsq.engines.vllm.config import ConnectorConfig
from hsq.engines.vllm.launch_args import check_extra_args, launch_command
from hsq.errors import ConfigError


def value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_command_asks_vllm_for_the_runs_layers_plus_the_final_state() -> None:
    cmd = launch_command("/m/llama", "/dev/shm/hsq0", [29, 2, 16], 32, port=8100, tp_size=2)
    assert cmd[:2] == ["env", "VLLM_USE_V2_MODEL_RUNNER=0"]
    assert cmd[2:7] == ["python", "-m", "vllm.entrypoints.cli.main", "serve", "/m/llama"]
    assert "--no-enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert value(cmd, "--port") == "8100" and value(cmd, "--tensor-parallel-size") == "2"
    spec = json.loads(value(cmd, "--speculative-config"))
    assert spec == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29, 32]}},
    }
    kv = json.loads(value(cmd, "--kv-transfer-config"))
    assert kv["kv_connector"] == "HsqConnector"
    assert kv["kv_connector_module_path"] == "hsq.engines.vllm.connector"
    assert kv["kv_role"] == "kv_producer"
    cfg = ConnectorConfig.from_extra(kv["kv_connector_extra_config"])
    assert cfg.layer_ids == (29, 2, 16) and cfg.dump_dir == Path("/dev/shm/hsq0")


def test_extra_arguments_pass_through_unless_they_break_dumps() -> None:
    cmd = launch_command("/m", "/d", [1], 4, extra_args=["--max-model-len", "4096"])
    assert cmd[-2:] == ["--max-model-len", "4096"]
    assert check_extra_args(["--kv-cache-dtype", "auto", "-pp=1"]) == []
    for bad in (
        ["--enable-prefix-caching"],
        ["--kv-cache-dtype", "fp8"],
        ["--kv-cache-dtype=fp8_e5m2"],
        ["--pipeline-parallel-size", "2"],
        ["--data-parallel-size", "2"],
        ["--speculative-config", "{}"],
        ["--kv-transfer-config={}"],
        ["-tp", "2"],
    ):
        assert check_extra_args(bad), bad
        with pytest.raises(ValueError):
            launch_command("/m", "/d", [1], 4, extra_args=bad)


def checkpoint(tmp_path: Path, arch: str = "LlamaForCausalLM", layers: int = 8) -> Path:
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": [arch], "num_hidden_layers": layers})
    )
    return model


def test_print_only_prints_the_command_and_the_layers_to_pin(tmp_path: Path) -> None:
    model = checkpoint(tmp_path)
    args = ["launch-vllm", "--model-path", str(model), "--dump-dir", str(tmp_path / "d")]
    result = CliRunner().invoke(cli, [*args, "--print-only", "--max-num-seqs", "8"])
    assert result.exit_code == 0, result.output
    assert (
        "eagle_aux_hidden_state_layer_ids" in result.output and "--max-num-seqs 8" in result.output
    )
    assert "hsq enqueue --layers 2,4,5" in result.output  # EAGLE-3's default for 8 layers
    assert not (tmp_path / "d").exists()  # --print-only starts and prepares nothing


@pytest.mark.parametrize(
    ("arch", "flags", "match"),
    [
        ("LlamaForCausalLM", ["--layers", "2,8"], "past the model"),
        ("GemmaForCausalLM", [], "not a model family"),
        ("DeepseekV3ForCausalLM", ["--layers", "0,3"], "layer id 0"),
        ("LlamaForCausalLM", ["--enable-prefix-caching"], "set by hsq"),
        ("LlamaForCausalLM", ["--num-layers", "9"], "config.json has 8"),
    ],
)
def test_launch_refusals(tmp_path: Path, arch: str, flags: list[str], match: str) -> None:
    model = checkpoint(tmp_path, arch)
    args = ["launch-vllm", "--model-path", str(model), "--dump-dir", str(tmp_path / "d")]
    result = CliRunner().invoke(cli, [*args, "--print-only", *flags])
    # a ConfigError: hsq's main turns it into one line and exit 2 (hsq/cli/main.py)
    assert isinstance(result.exception, ConfigError) and match in str(result.exception)


def test_a_hub_id_needs_the_layer_count(tmp_path: Path) -> None:
    args = ["launch-vllm", "--model-path", "org/model", "--dump-dir", str(tmp_path / "d")]
    result = CliRunner().invoke(cli, [*args, "--print-only"])
    assert isinstance(result.exception, ConfigError) and "--num-layers" in str(result.exception)
    ok = CliRunner().invoke(cli, [*args, "--print-only", "--num-layers", "32"])
    assert ok.exit_code == 0 and "2,16,29,32" in ok.output


def test_without_print_only_it_execs_the_command(tmp_path: Path) -> None:
    """A real exec: the Python given is a script that prints its argv, standing in for
    vLLM's environment; the dump dir is made private and an old marker removed first."""
    model = checkpoint(tmp_path)
    dump = tmp_path / "d"
    dump.mkdir(mode=0o755)
    (dump / "hsq-ready.json").write_text("{}")
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho ARGV "$@"\n')
    fake.chmod(0o755)
    cmd = [sys.executable, "-m", "hsq", "launch-vllm", "--model-path", str(model)]
    cmd += ["--dump-dir", str(dump), "--python", str(fake)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "ARGV -m vllm.entrypoints.cli.main serve" in out
    assert dump.stat().st_mode & 0o777 == 0o700 and not (dump / "hsq-ready.json").exists()
