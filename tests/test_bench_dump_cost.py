"""bench/dump_cost.py keeps running: its smallest preset, every mode, on the CPU.

No figure is asserted (the machine is shared); only that every mode ran its batches and
the dumping modes wrote what their dumps hold."""

from __future__ import annotations

from bench import dump_cost


def test_dump_cost_smoke_runs_every_mode() -> None:
    out = dump_cost.main(["--preset", "smoke", "--threads", "2"])
    (row,) = out["dump_cost"]
    assert set(row["modes"]) == set(dump_cost.MODES)
    assert all(m["tok_s"] > 0 and "vs_forward" in m for m in row["modes"].values())
    size = {mode: row["modes"][mode]["dump_bytes"] for mode in ("dump", "fp8", "prenorm")}
    assert size["fp8"] < size["dump"] < size["prenorm"]  # fp8 about half; prenorm one more [T, H]
    assert row["modes"]["engine"]["dump_bytes"] == 0 == row["modes"]["copy"]["dump_bytes"]
