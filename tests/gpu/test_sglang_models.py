"""hsq against a live SGLang: each model family extracted through hsq's worker with K
requests in flight, some samples longer than --chunked-prefill-size, SGLang SIGKILLed
mid-run and started again; then every sample done once and none dead, `verify --deep`
clean, token ids exact, every stored state equal to the reference forward (MoE: with the
server's own expert choices replayed) and the check failing on planted faults. The
figures go to HSQ_LIVE_RESULTS as they are measured (BENCHMARKS.md section 8)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hsq.node.procs import RedisServer
from tests.gpu import models_fixture as mf
from tests.gpu.phase import Model, Phase, assert_phase
from tests.gpu.results import Results
from tests.gpu.settings import LiveSettings

BUILDERS = {"llama": mf.llama, "deepseek": mf.deepseek, "kimi": mf.kimi}


def _phase(
    model: Model,
    live: LiveSettings,
    results: Results,
    fresh: tuple[Path, Path],
    redis: RedisServer,
    section: str,
    samples: int,
    **kw: Any,
) -> dict[str, Any]:
    wd, dd = fresh
    return Phase(model, live, results, section, wd, dd, redis.url, samples, **kw).run()


@pytest.mark.parametrize("name", ["llama", "deepseek", "kimi"])
def test_extract_kill_restart_equal(
    name: str,
    live: LiveSettings,
    results: Results,
    models_root: Path,
    fresh: tuple[Path, Path],
    redis: RedisServer,
) -> None:
    model = BUILDERS[name](models_root)
    samples = live.samples if name == "llama" else live.moe_samples
    fig = _phase(model, live, results, fresh, redis, name, samples, audit=model.moe)
    assert_phase(fig, samples=samples, moe=model.moe)
    if model.moe:
        a = fig["audit"]
        assert a["false_alarms_moe_rule"] == 0, a
        assert a["mixed_pairs"] > 0 and a["mixed_pairs_caught_moe_rule"] == a["mixed_pairs"], a


@pytest.mark.parametrize("name", ["deepseek", "kimi"])
def test_moe_without_routing_replay(
    name: str,
    live: LiveSettings,
    results: Results,
    models_root: Path,
    fresh: tuple[Path, Path],
    redis: RedisServer,
) -> None:
    """The MoE check with no proxy between worker and server (what a user's run looks
    like): the aux layer before the first MoE layer row by row, the rest under hsq's MoE
    allowance; the planted faults must still fail on every sample, and the audit (each
    sample again alone) must raise no false alarm and catch every mixed pair."""
    model = BUILDERS[name](models_root)
    samples = live.moe_samples
    fig = _phase(model, replace(live, routing="free"), results, fresh, redis, f"{name}-free",
                 samples, audit=True)  # fmt: skip
    assert_phase(fig, samples=samples, moe=True)
    assert fig["equality"]["routing_replayed"] is False
    a = fig["audit"]
    assert a["false_alarms_moe_rule"] == 0, a
    assert a["mixed_pairs"] > 0 and a["mixed_pairs_caught_moe_rule"] == a["mixed_pairs"], a


@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_server_fp8_dumps_with_prenorm(
    name: str,
    live: LiveSettings,
    results: Results,
    models_root: Path,
    fresh: tuple[Path, Path],
    redis: RedisServer,
) -> None:
    """Server-made fp8 dumps with the pre-norm final state. On DeepSeek the pre-norm state
    is captured by the hook's forward hook on the final norm (deepseek_v2 never passes
    `hidden_states_before_norm` to the logits processor): held to the reference's norm
    input like the other states."""
    model = BUILDERS[name](models_root)
    samples = max(10, live.moe_samples // 2)
    live = replace(live, routing="free")  # the proxy's replay is the kill test's
    fig = _phase(model, live, results, fresh, redis, f"{name}-fp8-prenorm", samples,
                 fp8_prenorm=True, kill=False)  # fmt: skip
    assert_phase(fig, samples=samples, moe=model.moe)
    assert fig["ready_marker"]["prenorm"] is True
    assert fig["equality"]["store_dtype"] == "fp8-e4m3" and fig["equality"]["prenorm_compared"]
