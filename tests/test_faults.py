"""Fault rules: parsing and selection (pure logic)."""

from __future__ import annotations

import pytest

from hsq.engines.reference.faults import FaultPlan, FaultRule
from hsq.errors import ConfigError


def test_parse_rule_with_options() -> None:
    rule = FaultRule.parse("slow:seconds=2.5,prob=0.25,times=3")
    assert (rule.mode, rule.seconds, rule.prob, rule.times) == ("slow", 2.5, 0.25, 3)


@pytest.mark.parametrize(
    "text", ["explode", "slow:seconds", "slow:speed=3", "split:times=-1", "nan:prob=2", "x:times=a"]
)
def test_bad_rules_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        FaultRule.parse(text)


def test_times_counts_down_then_stops() -> None:
    plan = FaultPlan([FaultRule("split", times=2)])
    picked = [plan.pick("fp") for _ in range(4)]
    assert [r.mode if r else None for r in picked] == ["split", "split", None, None]


def test_fingerprint_rule_follows_one_input_first_match_wins() -> None:
    plan = FaultPlan([FaultRule("nan", fingerprint="A"), FaultRule("slow", seconds=0)])
    assert plan.pick("A").mode == "nan"  # type: ignore[union-attr]
    assert plan.pick("B").mode == "slow"  # type: ignore[union-attr]


def test_probability_is_seeded() -> None:
    def run() -> list[bool]:
        plan = FaultPlan([FaultRule("stale", prob=0.3)], seed=7)
        return [plan.pick("x") is not None for _ in range(200)]

    first = run()
    assert first == run()
    assert 30 < sum(first) < 90
