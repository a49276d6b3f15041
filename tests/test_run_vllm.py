"""`hsq run --engine vllm` end to end with real processes: its own redis-server, two servers
started through the real `hsq launch-vllm` (its flags, its layer plan, its connector
config), each answered by the vLLM-shaped server of tests.support.fakevllm (vLLM's
completions API and capture rule over a transformers forward, hsq's real connector core
writing the dumps; not vLLM itself), and one `hsq worker --engine vllm` each.

`hsq launch-vllm --python P` runs `P -m vllm.entrypoints.cli.main serve ...`: here P is a
script that runs the fake with vLLM's own arguments instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hsq.producer.synthetic import write_synthetic
from tests.helpers import log_events
from tests.run_helpers import Node, no_node_left, worker_logs
from tests.support.tinymodel import build

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="process groups, /dev/shm"),
    pytest.mark.timeout(600),  # servers that import torch, on a loaded 2-core machine
    pytest.mark.usefixtures(no_node_left.__name__),
]
SAMPLES = 12


def test_hsq_run_starts_vllm_servers_through_the_launcher_and_workers_that_speak_vllm(
    tmp_path: Path,
) -> None:
    model = build(tmp_path / "tiny")
    python = tmp_path / "vllm-python"  # `P -m vllm.entrypoints.cli.main serve ...`
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} -m tests.support.fakevllm "$@"\n')
    python.chmod(0o755)
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, SAMPLES, seed=5, min_len=3, max_len=60, vocab=1000)
    out = tmp_path / "out"
    node = Node(tmp_path, "vllm", str(ds), "--out", str(out), "--engine", "vllm",
                "--model", str(model), "--gpus", "0,1", "--chunk-size", "2", "--json",
                "--verify", "--", "--python", str(python))  # fmt: skip
    assert node.wait(400) == 0, node.output()
    summary = node.summary()
    status = summary["status"]
    assert isinstance(status, dict) and (status["done"], status["dead"]) == (SAMPLES, 0)
    assert summary["verified"] == {"checked": SAMPLES, "ok": SAMPLES, "problems": 0}
    logs = worker_logs(out)
    assert len(logs) == 2  # one server per GPU (TP 1), a worker each
    for log in logs:
        [ready] = log_events(log, "hook_ready")
        assert ready["server"] == "vllm" and ready["layer_ids"] == [2, 4, 5]  # EAGLE-3's
    servers = sorted((out / ".hsq" / "logs").glob("server-*.log"))
    launched = [s.read_text() for s in servers]
    assert all("vllm.entrypoints.cli.main serve" in text for text in launched), launched
    assert all("fake vLLM at" in text for text in launched), launched
