"""A streamed run's budget against its largest sample, refused up front wherever the bytes
per token are known (hsq/producer/spoolcheck.py): `hsq enqueue` given the layers and the
hidden size, and `hsq run`, which reads them off the model before it starts anything.
Where they are not known the enqueue says the check happens at the first dump
(tests/test_stream_paths.py has that pause, and the re-enqueue of a run a dump pinned).
Real redis-server (the session's, or `hsq run`'s own); the CLI in process (`hsq run`: its own
process)."""

from __future__ import annotations

import json
from pathlib import Path

from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import HEADER_ALLOWANCE
from tests.helpers import hsq, hsq_process, store

PER_TOKEN = (3 + 1) * 64 * 2 + 16
"""The tiny model's output bytes a token in bf16: 3 aux layers and the last state of
hidden size 64, two bytes a value, and input_ids and loss_mask (int64 each)."""


def dataset(tmp: Path) -> tuple[Path, str, int]:
    """8 samples of 4..24 tokens; the path, the longest sample's id and its tokens."""
    path = tmp / "data.jsonl"
    write_synthetic(path, 8, seed=5, min_len=4, max_len=24)
    rows = [json.loads(x) for x in path.read_text().splitlines() if x]
    longest = max(rows, key=lambda r: len(r["input_ids"]))
    return path, str(longest["id"]), len(longest["input_ids"])


def enqueue(path: Path, out: Path, url: str, *flags: str) -> tuple[int, str, str]:
    args = ["enqueue", str(path), "--run", "r", "--out", str(out), "--redis", url]
    p = hsq(*args, "--no-progress", *flags)
    return p.returncode, p.stdout, p.stderr


def test_enqueue_with_layers_and_hidden_size_refuses_a_budget_below_the_largest_sample(
    tmp_path: Path, redis_url: str
) -> None:
    path, sid, tokens = dataset(tmp_path)
    needed = tokens * PER_TOKEN + HEADER_ALLOWANCE
    shape = ("--layers", "2,4,5", "--hidden-size", "64")
    rc, out, err = enqueue(path, tmp_path / "out", redis_url, "--spool-budget", "8K", *shape)
    assert rc == 2, (out, err)
    line = err.strip()
    assert line.count("\n") == 0, err
    assert f"{sid} ({tokens} tokens) needs {needed} bytes" in line, line
    assert f"give --spool-budget {needed} or more" in line, line
    assert store(redis_url, "r").load_config() is None  # nothing written
    # Exactly the bytes needed: accepted, and the output says what the largest sample needs.
    rc, out, err = enqueue(path, tmp_path / "out", redis_url, "--spool-budget", str(needed),
                           *shape)  # fmt: skip
    assert rc == 0, (out, err)
    assert f"the largest sample, {sid} ({tokens} tokens), needs" in out, out
    # Lowered below it on the existing run: refused, the budget recorded stays.
    rc, out, err = enqueue(path, tmp_path / "out", redis_url, "--spool-budget", "4K")
    assert rc == 2 and f"needs {needed} bytes" in err, (out, err)
    assert store(redis_url, "r").require_config().spool_budget == needed


def test_enqueue_without_the_model_s_shape_says_the_check_happens_at_the_first_dump(
    tmp_path: Path, redis_url: str
) -> None:
    path, _, _ = dataset(tmp_path)
    rc, out, err = enqueue(path, tmp_path / "out", redis_url, "--spool-budget", "1K")
    assert rc == 0, (out, err)
    assert "spool budget    1.0K, checked against each sample at the first dump" in out, out
    status = hsq("status", "--run", "r", "--redis", redis_url, "--json", check=True)
    stream = json.loads(status.stdout)["stream"]
    assert stream["budget"] == 1024 and stream["groups"][0]["name"] == "train", stream


def test_an_offline_run_s_status_has_no_stream(tmp_path: Path, redis_url: str) -> None:
    path, _, _ = dataset(tmp_path)
    rc, out, err = enqueue(path, tmp_path / "out", redis_url)
    assert rc == 0 and "spool budget" not in out, (out, err)
    status = hsq("status", "--run", "r", "--redis", redis_url, "--json", check=True)
    assert json.loads(status.stdout)["stream"] is None


def test_run_refuses_a_budget_below_the_largest_sample_before_starting_a_server(
    tmp_path: Path,
) -> None:
    path, sid, tokens = dataset(tmp_path)
    needed = tokens * PER_TOKEN + HEADER_ALLOWANCE
    out = tmp_path / "out"
    p = hsq_process("run", str(path), "--out", str(out), "--spool-budget", str(needed - 1))
    assert p.returncode == 2, (p.stdout, p.stderr)
    line = p.stderr.strip()
    assert line.count("\n") == 0, p.stderr
    assert f"{sid} ({tokens} tokens) needs {needed} bytes" in line, line
    assert "the reference server's tiny model" in line, line
    assert "servers " not in p.stdout and not (out / ".hsq" / "logs").exists(), p.stdout


def test_max_tokens_under_the_budget_needs_no_scan_and_says_so(
    tmp_path: Path, redis_url: str
) -> None:
    path, _, _ = dataset(tmp_path)
    flags = ("--layers", "2,4,5", "--hidden-size", "64", "--max-tokens", "64")
    rc, out, err = enqueue(path, tmp_path / "out", redis_url, "--spool-budget", "64K", *flags)
    assert rc == 0, (out, err)
    need = 64 * PER_TOKEN + HEADER_ALLOWANCE
    assert f"every sample fits (--max-tokens 64 needs {need / 1024:.1f}K" in out, out
