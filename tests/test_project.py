"""Project-level checks: the files users and CI rely on exist and parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_parses_and_its_build_context_exists() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "redis" in compose["services"]
    for svc in compose["services"].values():
        if "build" in svc:
            assert (ROOT / svc["build"] / "Dockerfile").exists()


def test_cli_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hsq", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "serve-reference" in out


def test_cli_bad_flag_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hsq", "serve-reference", "--dump-dir", "/tmp/x", "--port", "x"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    for line in text.splitlines():
        if "](docs/" in line:
            target = line.split("](", 1)[1].split(")", 1)[0]
            assert (ROOT / target).exists(), target
