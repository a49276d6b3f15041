"""The live run's argument handling without a GPU: scripts/sglang_live.sh's options
(checked by --dry-run), the HSQ_LIVE_* settings the GPU tests read, and `--tp N` in
`hsq launch-sglang`'s command (the TP size reaches SGLang once, validated)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hsq.engines.sglang.launch_args import launch_command, tp_problems
from tests.gpu.settings import LiveSettings, LiveSettingsError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sglang_live.sh"


def live_sh(
    tmp_path: Path, *args: str, version: str = "0.5.15"
) -> subprocess.CompletedProcess[str]:
    wh = tmp_path / "wh"
    wh.mkdir(exist_ok=True)
    (wh / "VERSION").write_text(version + "\n")
    env = {"PATH": "/usr/bin:/bin", "WHEELHOUSE": str(wh), "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True,
                          text=True, env=env, timeout=60)  # fmt: skip


def test_script_plans_jobs_with_the_tp_size(tmp_path: Path) -> None:
    r = live_sh(tmp_path, "--tp", "2", "--sglang-version", "0.5.15",
                "--job", "ds=tests/gpu -k deepseek", "--job", "kimi=tests/gpu -k kimi")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "sglang 0.5.15, tp 2" in r.stdout
    assert "job ds: HSQ_LIVE_TP=2 pytest -m gpu tests/gpu -k deepseek" in r.stdout
    assert "job kimi: HSQ_LIVE_TP=2 pytest -m gpu tests/gpu -k kimi" in r.stdout


def test_script_defaults(tmp_path: Path) -> None:
    r = live_sh(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "tp 1" in r.stdout and "job all: HSQ_LIVE_TP=1 pytest -m gpu tests/gpu" in r.stdout
    r = live_sh(tmp_path, "--", "tests/gpu/test_sglang_models.py", "-k", "llama")
    assert (
        "job all: HSQ_LIVE_TP=1 pytest -m gpu tests/gpu/test_sglang_models.py -k llama" in r.stdout
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "0"], "--tp 0: expected an integer >= 1"),
        (["--tp", "two"], "--tp two: expected an integer >= 1"),
        (["--tp", "-1"], "expected an integer >= 1"),
        (["--tp"], "--tp needs a value"),
        (["--sglang-version", "0.5"], "expected X.Y.Z"),
        (["--sglang-version", "0.5.17"], "but"),  # the bundle holds 0.5.15
        (["--cutlass", "/nonexistent.tar.xz"], "no such file"),
        (["--job", "no-equals"], "expected NAME=PYTEST ARGS"),
        (["--job", "a=x", "--job", "a=y"], "given twice"),
        (["--frobnicate"], "unknown option"),
        (["--test-timeout", "soon"], "expected seconds"),
    ],
)
def test_script_refuses_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    r = live_sh(tmp_path, *args)
    assert r.returncode == 2 and message in r.stderr, (r.stdout, r.stderr)


def test_settings_from_env() -> None:
    s = LiveSettings.from_env({"HSQ_LIVE_TP": "2", "HSQ_LIVE_WORK": "/w", "HSQ_LIVE_KILL": "0",
                               "HSQ_LIVE_SGLANG_VERSION": "0.5.17"})  # fmt: skip
    assert s.tp == 2 and s.work == Path("/w") and s.kill is False
    assert s.sglang_version == "0.5.17" and s.results is None and s.chunk == 1024
    assert LiveSettings.from_env({}).tp == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HSQ_LIVE_TP": "0"}, "HSQ_LIVE_TP=0: expected 1..8"),
        ({"HSQ_LIVE_TP": "x"}, "expected an integer"),
        ({"HSQ_LIVE_CHUNK": "512"}, "expected 1024..65536"),
        ({"HSQ_LIVE_KILL": "yes"}, "expected 0 or 1"),
        ({"HSQ_LIVE_SGLANG_VERSION": "latest"}, "expected X.Y.Z"),
        ({"HSQ_LIVE_TYPO": "1"}, "unknown live settings"),
    ],
)
def test_settings_refuse_bad_values(env: dict[str, str], message: str) -> None:
    with pytest.raises(LiveSettingsError, match=message):
        LiveSettings.from_env(env)


def test_launch_command_passes_the_tp_size_once() -> None:
    cmd = launch_command("/m", "/d", sglang_version="0.5.15", tp_size=2)
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd.count("--tp-size") == 1
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="expected an integer >= 1"):
            launch_command("/m", "/d", sglang_version="0.5.15", tp_size=bad)  # type: ignore[arg-type]
    for extra in (["--tp-size", "4"], ["--tensor-parallel-size=4"]):
        with pytest.raises(ValueError, match="give the tensor-parallel size once"):
            launch_command("/m", "/d", sglang_version="0.5.15", tp_size=2, extra_args=extra)
    assert tp_problems(8) == [] and tp_problems(1, ["--tp-size-x", "1"]) == []


def test_routing_is_proxy_or_free() -> None:
    assert LiveSettings.from_env({}).routing == "proxy"
    assert LiveSettings.from_env({"HSQ_LIVE_ROUTING": "free"}).routing == "free"
    with pytest.raises(LiveSettingsError, match="HSQ_LIVE_ROUTING"):
        LiveSettings.from_env({"HSQ_LIVE_ROUTING": "replay"})
