"""Server-made fp8 dumps are checked by the worker with the rules `verify --deep` applies:
one pure function, hsq.quant.check_quantized / quantized_problems.

A real `hsq worker` process and a real redis-server; the server is tests/hostile.py's (real
HTTP, real dumps), writing fp8-e4m3 dumps that break one invariant each:
- scale 0 on a row that is not all zero; scales doubled and values halved (rows top
  at 224, not 448). Before the fix: every sample marked done, `verify --deep` corrupt.
- scale 1e38 on a row whose largest value is 448: every value finite, the product
  not (reads back +Inf). Before the fix: done, and `verify --deep` ok."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hsq import quant
from hsq.dump.format import expected_shapes
from hsq.dump.write import write_dump
from hsq.errors import CorruptDumpError, NonFiniteDumpError
from hsq.producer.synthetic import write_synthetic
from hsq.states import FP8, LAST_TENSOR, scale_name, state_tensors
from tests.helpers import enqueue, spawn_worker, store
from tests.hostile import HIDDEN, LAYERS, HostileServer, meta_for, tensors_for

Coded = dict[str, torch.Tensor]


def zero_scale(c: Coded) -> None:
    c[scale_name(LAST_TENSOR)][0] = 0.0  # row 0 keeps its values


def rows_at_224(c: Coded) -> None:
    for name, _ in state_tensors(len(LAYERS)):
        c[scale_name(name)] *= 2
        c[name] = (c[name].float() / 2).to(torch.float8_e4m3fn)  # the same values, halved


def overflowing_scale(c: Coded) -> None:
    c[scale_name(LAST_TENSOR)][0] = 1e38  # row 0 tops at 448: 448e38 is Inf in float32


DAMAGES: dict[str, tuple[Callable[[Coded], None], str, str]] = {
    "zero_scale": (zero_scale, "corrupt_dump", "a zero scale on a row that is not all zero"),
    "rows_at_224": (rows_at_224, "corrupt_dump", "a row's largest value is not +-448"),
    "overflow": (overflowing_scale, "non_finite", "scale * 448 overflows float32"),
}


def fp8_dump_with(damage: Callable[[Coded], None]) -> Callable[..., None]:
    def writer(srv: HostileServer, _call: int, ids: list[int], rid: str) -> None:
        states = tensors_for(ids)
        coded: Coded = {}
        for name, groups in state_tensors(len(LAYERS)):
            coded[name], coded[scale_name(name)] = quant.quantize(states[name].float(), groups)
        damage(coded)
        shapes = expected_shapes(len(ids), len(LAYERS), HIDDEN, encoding=FP8)
        meta = replace(meta_for(ids, rid), encoding=FP8, tensors=shapes, format_version=0)
        write_dump(srv.dump_dir, srv.next_index(), meta, coded)

    return writer


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_a_worker_refuses_server_made_fp8_dumps_that_break_verifys_rules(
    tmp_path: Path, redis_url: str, case: str
) -> None:
    damage, reason, says = DAMAGES[case]
    run = f"inv{case.replace('_', '')}"[:20]
    srv = HostileServer(tmp_path / "dumps", fp8_dump_with(damage))
    try:
        ds = tmp_path / "data.jsonl"
        write_synthetic(ds, 6, seed=61, min_len=4, max_len=24)
        enqueue(ds, run, tmp_path / "out", redis_url, "--store-dtype", FP8,
                "--max-attempts", "2")  # fmt: skip
        w = spawn_worker(run, srv.url, srv.dump_dir, redis_url, tmp_path / "w.log", "--burst")
        assert w.proc.wait(120) == 0, w.log_tail()
    finally:
        srv.stop()
    st = store(redis_url, run)
    assert st.count(st.keys.done) == 0
    dead = st.dead_entries()
    assert len(dead) == 6, dead
    assert {e["reason"] for e in dead.values()} == {reason}, dead
    assert all(says in e["message"] for e in dead.values()), dead
    assert not list((tmp_path / "out").rglob("*.safetensors"))  # nothing written


def test_check_quantized_is_the_rule_verify_applies() -> None:
    """One function for both (pure: a process pool can run it)."""
    x = torch.randn(8, 3 * 16)
    q, s = quant.quantize(x, 3)
    quant.check_quantized(q, s, "aux")  # a correct quantization passes
    assert quant.quantized_problems(q, s) == []
    big = s.clone()
    big[0, 0] = 1e38
    assert quant.quantized_problems(q, big) == [
        "scale * 448 overflows float32: the values read back as Inf"
    ]
    with pytest.raises(NonFiniteDumpError, match="aux: scale \\* 448 overflows"):
        quant.check_quantized(q, big, "aux")
    zero = s.clone()
    zero[1, 2] = 0.0
    with pytest.raises(CorruptDumpError, match="zero scale") as info:
        quant.check_quantized(q, zero, "aux")
    assert not isinstance(info.value, NonFiniteDumpError)
