"""Project-level checks: the files users and CI rely on exist and parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import hsq, hsq_process

ROOT = Path(__file__).resolve().parents[1]


def test_compose_parses_and_its_build_context_exists() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "redis" in compose["services"]
    for svc in compose["services"].values():
        if "build" in svc:
            build = svc["build"] if isinstance(svc["build"], dict) else {"context": svc["build"]}
            assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).exists()


def test_cli_help_lists_commands() -> None:
    out = hsq("--help", check=True).stdout
    assert "serve-reference" in out


@pytest.mark.realproc
def test_cli_bad_flag_is_a_usage_error() -> None:
    proc = hsq_process("serve-reference", "--dump-dir", "/tmp/x", "--port", "x")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    for line in text.splitlines():
        if "](docs/" in line:
            target = line.split("](", 1)[1].split(")", 1)[0]
            assert (ROOT / target).exists(), target


def test_launch_sglang_prints_the_plugin_or_launcher_command_and_refuses_bad_flags() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "hsq",
                "launch-sglang",
                "--model-path",
                "/m",
                "--dump-dir",
                "/tmp/hsq-dd",
                "--print-only",
                *args,
            ],
            capture_output=True,
            text=True,
        )

    new = run("--sglang-version", "0.5.23", "--tp", "8")
    assert new.returncode == 0
    assert "-m sglang.launch_server" in new.stdout and "--disable-radix-cache" in new.stdout
    assert "SGLANG_HS_DUMP_DIR=/tmp/hsq-dd" in new.stdout and "--tp-size 8" in new.stdout
    old = run("--sglang-version", "0.5.9")
    assert old.returncode == 0 and "-m hsq.engines.sglang.legacy_launch" in old.stdout
    bad = run("--sglang-version", "0.5.23", "--", "--enable-dp-attention")
    assert bad.returncode == 2 and "not supported" in bad.stderr
    assert "Traceback" not in bad.stderr
