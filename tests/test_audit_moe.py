"""The audit's MoE allowance (hsq/closeness/moe.py): routing differences between a batched
and an alone forward pass, mix-ups do not, dense models keep the row rule; and the
reference server's `mix` fault is still caught with the allowance on (real processes)."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hsq import quant  # noqa: E402
from hsq.closeness.moe import MAX_DEVIATING_ROW_FRACTION, allowance, routes_tokens  # noqa: E402
from hsq.closeness.rule import States, compare_states, dump_states  # noqa: E402
from hsq.dump.find import remove_dump, scan_by_rid  # noqa: E402
from hsq.dump.format import fingerprint  # noqa: E402
from hsq.dump.read import Expected, read_dump  # noqa: E402
from hsq.outputs import open_output  # noqa: E402
from tests.conftest import generate  # noqa: E402
from tests.helpers import enqueue  # noqa: E402
from tests.support import audits  # noqa: E402
from tests.support.audits import (  # noqa: E402
    dataset,
    extract_batched,
    mixed_samples,
)
from tests.support.procs import ReferenceServer  # noqa: E402

clean, mixing = audits.clean, audits.mixing  # the servers' fixtures, for pytest to find here

DS = "DeepseekV3ForCausalLM"


def _stored(aux: Any, last: Any, t: int) -> SimpleNamespace:
    return SimpleNamespace(input_ids=torch.arange(t), metadata={quant.META_KEY: "bf16"},
                           aux_hidden_states=aux.to(torch.bfloat16),
                           last_hidden_state=last.to(torch.bfloat16))  # fmt: skip


def _fresh(aux: Any, last: Any) -> States:
    return States({"aux_hidden_states": aux.float(), "last_hidden_state": last.float()}, "plain")


def _flip_rows(x: Any, rows: list[int], seed: int = 1) -> Any:
    """Rows moved the way a routing flip moves them (cosine ~0.95, far from another token)."""
    g = torch.Generator().manual_seed(seed)
    y = x.clone()
    for r in rows:
        y[r] = x[r] + 0.3 * x[r].norm() / x.shape[1] ** 0.5 * torch.randn(x.shape[1], generator=g)
    return y


def test_architectures() -> None:
    assert routes_tokens("DeepseekV3ForCausalLM") and routes_tokens(
        "KimiK25ForConditionalGeneration"
    )
    assert routes_tokens("Qwen3MoeForCausalLM") and routes_tokens("MixtralForCausalLM")
    assert not routes_tokens("LlamaForCausalLM") and not routes_tokens(None)


def test_routing_flips_pass_on_moe_only_and_mixups_fail() -> None:
    t = 32
    g = torch.Generator().manual_seed(0)
    aux, last = torch.randn(t, 3 * 64, generator=g), torch.randn(t, 64, generator=g)
    kept = _stored(aux, last, t)
    ids = list(range(t))
    flipped = (_flip_rows(aux, [5, 17]), _flip_rows(last, [5, 17]))
    assert not compare_states(kept, ids, _fresh(*flipped)).ok  # the dense row rule flags them
    v = compare_states(kept, ids, _fresh(*flipped), architecture=DS)
    assert v.ok and "2 of 32 rows" in v.detail, v.detail
    other = (torch.randn(t, 3 * 64, generator=g), torch.randn(t, 64, generator=g))
    v = compare_states(kept, ids, _fresh(*other), architecture=DS)
    assert not v.ok and "beyond the MoE allowance" in v.detail
    too_many = list(range(0, t, 3))  # 11 of 32 rows > 25 %
    assert len(too_many) > MAX_DEVIATING_ROW_FRACTION * t
    v = compare_states(kept, ids, _fresh(_flip_rows(aux, too_many), last), architecture=DS)
    assert not v.ok


def test_allowance_edges() -> None:
    a = torch.randn(2, 8)
    b = a.clone()
    b[1] = torch.randn(8)  # a 2-token mix-up: row 0 (BOS) equal, row 1 another token's
    r = allowance(a, b, min_cosine=0.999, max_abs_of_norm=0.01)
    assert not r.ok and r.deviating == 1 and r.median_cosine < 0.999
    one = allowance(a[:1], a[:1], min_cosine=0.999, max_abs_of_norm=0.01)
    assert one.ok and one.deviating == 0
    assert allowance(a[:0], a[:0], min_cosine=0.999, max_abs_of_norm=0.01).ok


def _alone(server: ReferenceServer, ids: list[int]) -> Any:
    rid = f"hsq-alone-{secrets.token_hex(4)}"
    generate(server.url, ids, rid).raise_for_status()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        mine = scan_by_rid(server.dump_dir).complete.get(rid, [])
        if mine:
            try:
                return read_dump(mine[0].path, Expected(rid, fingerprint(ids), len(ids)))
            finally:
                remove_dump(mine[0].path)
        time.sleep(0.01)
    raise AssertionError(f"no dump for {rid}")


def test_the_reference_servers_mix_fault_is_caught_with_the_moe_allowance(
    tmp_path: Path,
    mixing: ReferenceServer,
    clean: ReferenceServer,
    redis_url: str,
) -> None:
    """A run extracted through the mixing server, audited alone on the clean one with the
    allowance on (as if the model were an MoE): exactly the mixed samples mismatch."""
    run = "moemix"
    enqueue(dataset(tmp_path, run, seed=41), run, tmp_path / "out", redis_url, "--chunk-size", "4")
    extract_batched(tmp_path, run, mixing, redis_url)
    mixed = mixed_samples(mixing, run)
    assert mixed, "the lined-up batch mixed nothing"
    flagged = set()
    outputs = [open_output(f) for f in sorted((tmp_path / "out").rglob("*.safetensors"))]
    assert len(outputs) == 12
    for o in outputs:
        ids = o.input_ids.tolist()
        dump = _alone(clean, ids)
        v = compare_states(o, ids, dump_states(dump), architecture=DS)
        if not v.ok:
            flagged.add(o.sample_id)
    assert flagged == mixed
