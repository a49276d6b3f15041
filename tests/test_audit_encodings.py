"""The audit on every encoding and every stored tensor, with real
reference servers making fp8-e4m3 dumps (`--dump-encoding fp8-e4m3`), real redis-server
and real `hsq worker` / `hsq audit` processes.

Before: the audit compared a server-made fp8 dump's raw float8 values (without their scales)
with the stored states: every good sample of an fp8 run was "mismatched", and the worker's
--audit-fraction and `hsq audit --requeue` deleted the good files; and the audit never
compared `last_hidden_state_prenorm`, so a server swapping only that tensor passed.
The pure rules (tolerance, untrusted comparisons, confirmation) are at the end."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hsq import quant
from hsq.closeness.rule import (
    FP8_ROUNDING,
    MIN_COSINE,
    States,
    Verdict,
    compare,
    compare_states,
    confirm,
    tolerance,
)
from hsq.states import AUX_TENSOR, BF16, FP8, LAST_TENSOR, PLAIN, PRENORM_TENSOR
from tests.helpers import enqueue, log_events, start_worker, store
from tests.support.audits import K, N, audit, dataset, extract_batched, mismatches, mixed_samples
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
pytestmark = pytest.mark.timeout(600)  # real servers, a worker and several audits per test
BATCH = ("--max-batch-requests", str(K))


@pytest.fixture(scope="module")
def fp8_clean(server_factory: Factory) -> ReferenceServer:
    return server_factory(*BATCH, "--dump-encoding", FP8, "--prenorm", name="f8c").wait_ready()


@pytest.fixture(scope="module")
def fp8_mix_prenorm(server_factory: Factory) -> ReferenceServer:
    return server_factory(
        *BATCH, "--dump-encoding", FP8, "--prenorm", "--fault", "mix_prenorm", name="f8mp"
    ).wait_ready()


@pytest.fixture(scope="module")
def plain_clean(server_factory: Factory) -> ReferenceServer:
    return server_factory(*BATCH, "--prenorm", name="plc").wait_ready()


def checksums(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.safetensors"))
    }


def test_an_fp8_run_from_a_correct_fp8_server_passes_every_audit_and_keeps_its_files(
    tmp_path: Path, fp8_clean: ReferenceServer, plain_clean: ReferenceServer, redis_url: str
) -> None:
    """Before the fix: the worker dead-lettered all N as audit_mismatch and deleted
    their files; `hsq audit --requeue` called all N mismatched and requeued them."""
    run = "f8ok"
    out = tmp_path / "out"
    enqueue(dataset(tmp_path, run, seed=51), run, out, redis_url, "--chunk-size", "4",
            "--store-dtype", FP8)  # fmt: skip
    w = extract_batched(tmp_path, run, fp8_clean, redis_url, "--audit-fraction", "1")
    st = store(redis_url, run)
    assert st.count(st.keys.dead) == 0, st.dead_entries()
    assert st.count(st.keys.done) == N
    assert len(log_events(w.log_path, "audit_ok")) == N
    files = checksums(out / run)
    assert len(files) == N
    # fp8 vs fp8 (the same kind of server) and fp8 vs plain (a plain server's states)
    for server in (fp8_clean, plain_clean):
        code, text = audit(run, server, redis_url, "--requeue")
        assert code == 0, text
        assert f"audited         {N} of {N}" in text and "mismatched      0" in text, text
        assert "requeued        0" in text, text
    assert st.count(st.keys.done) == N
    assert checksums(out / run) == files  # not one file touched


def test_the_audit_compares_the_prenorm_state_and_finds_a_server_swapping_only_it(
    tmp_path: Path,
    fp8_mix_prenorm: ReferenceServer,
    fp8_clean: ReferenceServer,
    plain_clean: ReferenceServer,
    redis_url: str,
) -> None:
    """With the widest bounds (fp8 stored; audited by an fp8 and a plain server).
    Before the fix: `hsq audit` called every sample a match."""
    run = "mpre"
    out = tmp_path / "out"
    enqueue(dataset(tmp_path, run, seed=52), run, out, redis_url, "--chunk-size", "4",
            "--store-dtype", FP8, "--prenorm")  # fmt: skip
    extract_batched(tmp_path, run, fp8_mix_prenorm, redis_url)
    st = store(redis_url, run)
    assert st.count(st.keys.done) == N
    mixed = mixed_samples(fp8_mix_prenorm, run)
    assert len(mixed) >= K, mixed
    for server in (fp8_clean, plain_clean):
        code, text = audit(run, server, redis_url)
        assert code == 1, text
        assert mismatches(text) == mixed, text
        assert "last_hidden_state_prenorm differs" in text
        assert "confirmed by a second fresh extraction" in text
    code, text = audit(run, fp8_clean, redis_url, "--requeue")
    assert code == 1 and f"requeued        {len(mixed)}" in text, text
    w = start_worker(tmp_path, run, fp8_clean, redis_url, "--burst", name="redo")
    assert w.proc.wait(300) == 0, w.log_tail()
    code, text = audit(run, plain_clean, redis_url)
    assert code == 0 and "mismatched      0" in text, text


def test_a_worker_auditing_an_fp8_prenorm_run_dead_letters_exactly_the_swapped_samples(
    tmp_path: Path, fp8_mix_prenorm: ReferenceServer, redis_url: str
) -> None:
    run = "wmpre"
    enqueue(dataset(tmp_path, run, seed=53), run, tmp_path / "out", redis_url,
            "--chunk-size", "4", "--store-dtype", FP8, "--prenorm")  # fmt: skip
    w = extract_batched(tmp_path, run, fp8_mix_prenorm, redis_url, "--audit-fraction", "1")
    mixed = mixed_samples(fp8_mix_prenorm, run)
    assert len(mixed) >= K, mixed
    st = store(redis_url, run)
    dead = st.dead_entries()
    assert set(dead) == mixed and {e["reason"] for e in dead.values()} == {"audit_mismatch"}
    assert st.count(st.keys.done) == N - len(mixed)
    assert len(log_events(w.log_path, "audit_ok")) == N - len(mixed)


# ------------------------------------------------------------------------------ pure rules


def states(gen: torch.Generator, t: int = 16, h: int = 64) -> dict[str, torch.Tensor]:
    return {
        AUX_TENSOR: torch.randn(t, 3 * h, generator=gen),
        LAST_TENSOR: torch.randn(t, h, generator=gen),
        PRENORM_TENSOR: 5 * torch.randn(t, h, generator=gen),
    }


def fp8(s: dict[str, torch.Tensor]) -> States:
    groups = {AUX_TENSOR: 3, LAST_TENSOR: 1, PRENORM_TENSOR: 1}
    return States(
        {k: quant.dequantize(*quant.quantize(v, groups[k]), torch.float32) for k, v in s.items()},
        FP8,
    )


def test_the_fp8_bound_follows_from_e4m3s_step_and_admits_worst_case_rounding() -> None:
    assert FP8_ROUNDING == 2.0**-4
    one, two = tolerance(1, 4096), tolerance(2, 4096)
    assert tolerance(0, 4096).min_cosine == MIN_COSINE
    assert 0.994 < one.min_cosine < 0.995 and 0.985 < two.min_cosine < 0.986
    assert one.max_abs_of_norm < two.max_abs_of_norm < 0.15
    # Values just below the middle of two e4m3 steps round as far as rounding can.
    gen = torch.Generator().manual_seed(3)
    x = (1 + 2**-4 - 1e-6) * 2.0 ** torch.randint(-5, 8, (8, 4096), generator=gen).float()
    x[:, 0] = 448.0  # the row's absmax: scale 1, so x is what e4m3 rounds
    x *= torch.where(torch.rand(8, 4096, generator=gen) < 0.5, -1.0, 1.0)
    q = quant.dequantize(*quant.quantize(x, 1), torch.float32)
    assert float(((q - x).abs() / x.abs()).max()) <= FP8_ROUNDING
    plain = States({LAST_TENSOR: x}, PLAIN)
    assert compare(States({LAST_TENSOR: q}, FP8), plain).ok


@pytest.mark.parametrize("kinds", [(BF16, PLAIN), (FP8, PLAIN), (PLAIN, FP8), (FP8, FP8)])
def test_every_encoding_pair_tolerates_batching_noise_and_catches_swapped_rows(
    kinds: tuple[str, str],
) -> None:
    """Each stored tensor on its own: batching noise passes, another token's rows (in
    any one tensor, the pre-norm state included) fail."""
    gen = torch.Generator().manual_seed(0)
    base = states(gen)
    noisy = {k: v * (1 + 1e-3 * torch.randn(v.shape, generator=gen)) for k, v in base.items()}

    def enc(kind: str, s: dict[str, torch.Tensor]) -> States:
        if kind == BF16:  # a bf16 output: the states rounded to bf16
            return States({k: v.bfloat16().float() for k, v in s.items()}, PLAIN)
        return fp8(s) if kind == FP8 else States(s, PLAIN)

    kept = enc(kinds[0], base)
    assert compare(kept, enc(kinds[1], noisy)).ok
    for name in base:
        swapped = {**noisy, name: noisy[name].roll(1, dims=0)}
        v = compare(kept, enc(kinds[1], swapped))
        assert v.mismatch and v.detail.startswith(f"{name} differs"), (name, v)


def test_a_comparison_that_cannot_be_trusted_never_counts_as_a_mismatch() -> None:
    gen = torch.Generator().manual_seed(1)
    s = states(gen)
    fresh = States(dict(s), PLAIN)
    no_prenorm = States({k: v for k, v in s.items() if k != PRENORM_TENSOR}, PLAIN)
    assert not compare(fresh, no_prenorm).trusted  # a stored tensor the fresh one lacks
    inf = States({**s, LAST_TENSOR: s[LAST_TENSOR].clone().fill_(float("inf"))}, PLAIN)
    v = compare(inf, fresh)
    assert not v.trusted and not v.mismatch and "not finite" in v.detail
    v.raise_for_mismatch()  # no AuditMismatchError


def test_a_mismatch_stands_only_when_a_second_fresh_extraction_confirms_it() -> None:
    bad = Verdict(False, "x differs", 0.5, 0.5)
    good = Verdict(True, "fine")
    assert confirm(good, bad, bad) is good
    assert confirm(bad, bad, good).mismatch  # both fresh agree, both fail: confirmed
    assert not confirm(bad, good, good).trusted  # not reproduced
    assert not confirm(bad, bad, bad).trusted  # the server's two extractions disagree
    assert not confirm(bad, Verdict(False, "?", trusted=False), good).trusted


def test_compare_states_decodes_an_fp8_output_with_its_scales() -> None:
    """The stored side as open_output(raw=True) gives it: fp8 values and scales."""
    gen = torch.Generator().manual_seed(2)
    s = states(gen)
    raw: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, groups in ((AUX_TENSOR, 3), (LAST_TENSOR, 1), (PRENORM_TENSOR, 1)):
        raw[name], scales[name + "_scale"] = quant.quantize(s[name], groups)
    stored = SimpleNamespace(
        sample_id="s",
        input_ids=torch.arange(16),
        metadata={quant.META_KEY: FP8},
        aux_hidden_states=raw[AUX_TENSOR],
        last_hidden_state=raw[LAST_TENSOR],
        last_hidden_state_prenorm=raw[PRENORM_TENSOR],
        scales=scales,
    )
    ids = list(range(16))
    assert compare_states(stored, ids, fp8(s)).ok
    assert compare_states(stored, ids, States(s, PLAIN)).ok
    assert compare_states(stored, [*ids[:-1], 99], States(s, PLAIN)).mismatch
