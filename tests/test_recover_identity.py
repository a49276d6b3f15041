"""Recover's rules about the run's config and identity, in the producer (not in the
CLI): pure logic, no Redis (tests/test_recover.py runs the command)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from hsq.errors import ConfigError
from hsq.producer.identity import IdentityHint, decide_identity, given_conflicts
from hsq.producer.recover import RecoverRequest, recover_config
from hsq.runconfig import RunConfig

KNOWN = RunConfig(
    run="r", dataset="/data/d.jsonl", out="/out", created=0.0, model_id="m@1", layer_ids=[2, 5]
)


def test_a_known_run_keeps_its_config_when_what_is_given_agrees() -> None:
    req = RecoverRequest("r", Path("/data/d.jsonl"), Path("/out"), hint=IdentityHint("m@1", [2, 5]))
    assert recover_config(KNOWN, req) is KNOWN


@pytest.mark.parametrize(
    ("req", "said"),
    [
        (RecoverRequest("r", Path("/data/other.jsonl")), "dataset: recorded /data/d.jsonl"),
        (RecoverRequest("r", out=Path("/elsewhere")), "out: recorded /out, given /elsewhere"),
        (RecoverRequest("r", hint=IdentityHint("m@2")), "model_id: recorded 'm@1', given 'm@2'"),
        (RecoverRequest("r", hint=IdentityHint(layer_ids=[1])), "layer_ids: recorded [2, 5]"),
    ],
)
def test_a_known_run_refuses_what_contradicts_it(req: RecoverRequest, said: str) -> None:
    with pytest.raises(ConfigError, match="exists with other settings") as err:
        recover_config(KNOWN, req)
    assert said in str(err.value)


def test_an_unknown_run_needs_its_dataset_and_output_root() -> None:
    with pytest.raises(ConfigError, match="not in Redis: give DATASET and --out"):
        recover_config(None, RecoverRequest("r", Path("/data/d.jsonl")))


def test_an_unknown_run_takes_what_is_given(tmp_path: Path) -> None:
    req = RecoverRequest(
        "r", tmp_path / "d.jsonl", tmp_path, chunk_size=4, store_dtype="fp8-e4m3", prenorm=True
    )
    cfg = recover_config(None, req)
    assert (cfg.dataset, cfg.out) == (str(tmp_path / "d.jsonl"), str(tmp_path))
    assert (cfg.chunk_size, cfg.store_dtype, cfg.prenorm) == (4, "fp8-e4m3", True)
    assert (cfg.model_id, cfg.layer_ids) == (None, None)  # decided from the files later


def test_a_hint_is_a_contradiction_only_against_a_recorded_pin() -> None:
    unpinned = RunConfig(run="r", dataset="/d", out="/o", created=0.0)
    assert given_conflicts(unpinned, IdentityHint("m@2", [1])) == []
    assert given_conflicts(KNOWN, IdentityHint("m@1", [2, 5])) == []
    assert len(given_conflicts(KNOWN, IdentityHint("m@2", [1]))) == 2


def test_the_recorded_identity_wins_and_a_contradiction_is_refused() -> None:
    counts: Counter[tuple[str, tuple[int, ...]]] = Counter({("m@1", (2, 5)): 3, ("m@9", (2, 5)): 7})
    ident, how = decide_identity(KNOWN, IdentityHint(), counts)
    assert ident == ("m@1", [2, 5]) and "recorded in the run; 3 of 10 files" in how
    with pytest.raises(ConfigError, match="model_id: recorded 'm@1', given 'm@9'"):
        decide_identity(KNOWN, IdentityHint("m@9"), counts)


def test_the_states_dtype_is_the_recorded_pin_else_the_majority_and_a_tie_is_refused() -> None:
    """The dtype of the states is part of recover's identity."""
    from dataclasses import replace

    from hsq.producer.identity import decide_states_dtype

    mixed: Counter[str] = Counter({"bfloat16": 8, "float32": 4})
    assert decide_states_dtype(KNOWN, mixed, 12)[0] == "bfloat16"
    pinned = replace(KNOWN, dump_dtype="float32")
    dtype, how = decide_states_dtype(pinned, mixed, 12)
    assert dtype == "float32" and "recorded in the run; 4 of 12" in how
    assert decide_states_dtype(KNOWN, Counter(), 3) == (None, "not decided")  # fp8 files
    tie = r"no majority \(6 files of bfloat16; 6 files of float32\)"
    with pytest.raises(ConfigError, match=tie):
        decide_states_dtype(KNOWN, Counter({"bfloat16": 6, "float32": 6}), 12)
