"""tests/gpu/longctx.py's pure parts on a CPU: the per-sample windows of the long-context
live test and the bytes per token docs/outputs.md states."""

from __future__ import annotations

from hsq.runconfig import RunConfig
from tests.gpu.longctx import Point, done_times, dump_bytes_per_token, per_sample


def _p(t: float, rss: int, dump: int) -> Point:
    return Point(t, rss, rss + 1, dump, 0)


def test_each_window_is_the_samples_own() -> None:
    points = [_p(0.5, 10, 0), _p(1.5, 30, 7), _p(2.0, 20, 0), _p(2.5, 50, 9), _p(3.5, 99, 99)]
    got = per_sample([("a", 2.0), ("b", 3.0)], points, start=0.0)
    assert got["a"]["worker_rss_peak"] == 30 and got["a"]["dump_dir_peak"] == 7
    assert got["a"]["readings"] == 3  # (0, 2.0]: the reading at 2.0 is a's
    assert got["b"]["worker_rss_peak"] == 50 and got["b"]["worker_tree_rss_peak"] == 51
    assert got["b"]["readings"] == 1  # after b's done mark: no one's


def test_done_times_read_the_workers_timestamps() -> None:
    ev = [{"sample": "a", "timestamp": "2026-12-05T10:00:00.5Z"}]
    assert done_times(ev) == [("a", 1796464800.5)]


def test_dump_bytes_match_the_runs_bytes_per_token() -> None:
    for prenorm in (False, True):
        for store, fp8 in (("bf16", False), ("fp8-e4m3", True)):
            cfg = RunConfig(run="r", dataset="/d", out="/o", layer_ids=[2, 16, 29],
                            hidden_size=4096, prenorm=prenorm, store_dtype=store)  # fmt: skip
            ids = 16  # the output's input_ids and loss_mask, int64 each; a dump has neither
            want = cfg.spool_bytes_per_token()
            assert dump_bytes_per_token(4096, 3, prenorm=prenorm, fp8=fp8) + ids == want
    assert dump_bytes_per_token(4096, 3, prenorm=False, fp8=False) * 65536 == 2 * 2**30


def test_long_settings_are_validated() -> None:
    import pytest

    from tests.gpu.settings import LiveSettings, LiveSettingsError

    s = LiveSettings.from_env({"HSQ_LIVE_LONG": "16384,65536", "HSQ_LIVE_LONG_LAYERS": "32"})
    assert s.long == (16384, 65536) and s.long_layers == 32 and s.long_reference_max == 65536
    assert LiveSettings.from_env({}).long == (16384, 32768, 65536)
    for bad in ("16k", "512", "16384,,1"):
        with pytest.raises(LiveSettingsError, match="HSQ_LIVE_LONG="):
            LiveSettings.from_env({"HSQ_LIVE_LONG": bad})
