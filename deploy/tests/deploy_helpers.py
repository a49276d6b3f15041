"""Helpers shared by the deployment tests (test_compose.py, test_slurm.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
HSQ = str(VENV / "bin" / "hsq")


def require(*commands: str) -> None:
    """These tests run only where they can start everything for real: say what is missing."""
    if os.geteuid() != 0:
        pytest.fail("the deployment tests start system daemons: run them as root")
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        pytest.fail(f"missing {' '.join(missing)}: run scripts/setup_deploy.sh (make setup-deploy)")


def wait_for(what: str, pred: Callable[[], bool], timeout: float, interval: float = 1.0) -> None:
    """Poll until pred() holds; a liveness bound, not a speed assertion."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Ports:
    """Distinct free ports, single or in blocks (the recipes use base + i). Ephemeral ports
    can come out in sequence, so a block is checked against every port handed out."""

    def __init__(self) -> None:
        self.taken: set[int] = set()

    def block(self, n: int = 1) -> int:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = int(s.getsockname()[1])
            ports = set(range(base, base + n))
            if not ports & self.taken and all(port_free(p) for p in ports):
                self.taken |= ports
                return base


def sh(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run a command, fail with its output when it fails, return stdout."""
    p = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
    )
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout


def run_status(status_json: str) -> dict[str, Any]:
    """The one JSON object `hsq status --run R --json` prints."""
    out: dict[str, Any] = json.loads(status_json.strip().splitlines()[-1])
    return out


def prometheus_targets(base_url: str, job: str) -> list[dict[str, Any]]:
    """Prometheus's active targets of one scrape job (/api/v1/targets)."""
    try:
        r = httpx.get(f"{base_url}/api/v1/targets", params={"state": "active"}, timeout=5)
    except httpx.HTTPError:
        return []
    targets: list[dict[str, Any]] = r.json()["data"]["activeTargets"]
    return [t for t in targets if t["labels"].get("job") == job]


def prometheus_value(base_url: str, query: str) -> float | None:
    """The value of an instant query with one series, None when it has none."""
    try:
        r = httpx.get(f"{base_url}/api/v1/query", params={"query": query}, timeout=5)
    except httpx.HTTPError:
        return None
    result = r.json()["data"]["result"]
    return float(result[0]["value"][1]) if len(result) == 1 else None
