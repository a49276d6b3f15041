"""`hsq audit` and `hsq worker --audit-fraction`, with real reference
servers: one batching with the `mix` fault (a dump gets another request's states of the
same length: every metadata check passes, verify --deep too), one batching cleanly.

A batch of K requests is lined up without timing: the server is paused, the worker sends
K requests, the test waits until the server holds K pending, then resumes it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hsq.dump.format import expected_shapes
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.dump.write import write_dump
from hsq.engines.reference.faults import FaultRule, mix_sources
from hsq.producer.synthetic import write_synthetic
from hsq.states import FP8, LAST_TENSOR, PRENORM_TENSOR, scale_name, state_tensors
from tests.helpers import enqueue, hsq, log_events, spawn_worker, start_worker, store, wait_until
from tests.hostile import HIDDEN, IDENT, LAYERS, HostileServer, meta_for, tensors_for
from tests.support import audits
from tests.support.audits import (
    K,
    N,
    audit,
    dataset,
    extract_batched,
    info,
    mismatches,
    mixed_samples,
)
from tests.support.procs import ReferenceServer

clean, mixing = audits.clean, audits.mixing  # the servers' fixtures, for pytest to find here


def test_mix_sources_rotates_states_among_requests_of_one_length() -> None:
    assert mix_sources([4, 4, 4, 4], [True] * 4) == [1, 2, 3, 0]
    assert mix_sources([4, 5, 4, 6], [True] * 4) == [2, 1, 0, 3]  # 5 and 6 alone: their own
    assert mix_sources([4, 4], [False, True]) == [0, 0]
    assert mix_sources([7], [True]) == [0]
    assert FaultRule.parse("mix").mode == "mix"


def test_audit_finds_a_mixing_server_and_requeue_repairs_the_run(
    tmp_path: Path, mixing: ReferenceServer, clean: ReferenceServer, redis_url: str
) -> None:
    run = "mixr"
    enqueue(dataset(tmp_path, run, seed=31), run, tmp_path / "out", redis_url, "--chunk-size", "4")
    extract_batched(tmp_path, run, mixing, redis_url)
    st = store(redis_url, run)
    assert st.count(st.keys.done) == N
    deep = hsq("verify", "--run", run, "--redis", redis_url, "--deep", "--no-progress")
    assert deep.returncode == 0, deep.stdout  # every check on metadata and bytes passes
    mixed = mixed_samples(mixing, run)
    assert len(mixed) >= K, mixed  # the lined-up batch of K, at least

    code, text = audit(run, clean, redis_url)
    assert code == 1, text
    assert mismatches(text) == mixed, text
    assert st.count(st.keys.done) == N  # without --requeue nothing changes

    code, text = audit(run, clean, redis_url, "--requeue")
    assert code == 1 and mismatches(text) == mixed and f"requeued        {len(mixed)}" in text
    assert st.count(st.keys.done) == N - len(mixed)
    w = start_worker(tmp_path, run, clean, redis_url, "--burst", name="redo")
    assert w.proc.wait(300) == 0, w.log_tail()
    code, text = audit(run, clean, redis_url, progress=True)
    assert code == 0 and "mismatched      0" in text, text
    assert f"| {N}/{N} [" in text, text  # the bar has its total (it had none: `24it`)


def test_no_false_alarm_on_states_a_batching_server_computed_correctly(
    tmp_path: Path, mixing: ReferenceServer, clean: ReferenceServer, redis_url: str
) -> None:
    """Batched states differ from single ones in the last bits: within the tolerance.
    Audited through the mixing server too: alone in its batch, it is correct."""
    run = "cln"
    before = info(clean)
    enqueue(dataset(tmp_path, run, seed=32), run, tmp_path / "out", redis_url, "--chunk-size", "4")
    extract_batched(tmp_path, run, clean, redis_url)
    after = info(clean)
    served = after["requests_served"] - before["requests_served"]
    assert after["batches_run"] - before["batches_run"] < served  # some forwards were batched
    for server in (clean, mixing):
        code, text = audit(run, server, redis_url)
        assert code == 0, text
        assert f"audited         {N} of {N}" in text and "mismatched      0" in text, text


def test_audit_refuses_a_dump_dir_a_live_worker_holds(
    tmp_path: Path, clean: ReferenceServer, redis_url: str
) -> None:
    run = "own"
    enqueue(dataset(tmp_path, run, seed=33), run, tmp_path / "out", redis_url)
    w = start_worker(tmp_path, run, clean, redis_url, name="holder")
    try:
        st = store(redis_url, run)
        wait_until(lambda: st.count(st.keys.done) == N, timeout=120)
        code, text = audit(run, clean, redis_url)
        assert code == 2 and "owned by another live worker" in text, text
    finally:
        w.stop()


def test_a_worker_auditing_continuously_dead_letters_exactly_the_mixed_samples(
    tmp_path: Path, mixing: ReferenceServer, clean: ReferenceServer, redis_url: str
) -> None:
    run = "wau"
    enqueue(dataset(tmp_path, run, seed=34), run, tmp_path / "out", redis_url, "--chunk-size", "4")
    w = extract_batched(tmp_path, run, mixing, redis_url, "--audit-fraction", "1")
    mixed = mixed_samples(mixing, run)
    assert len(mixed) >= K, mixed
    st = store(redis_url, run)
    dead = st.dead_entries()
    assert set(dead) == mixed and {e["reason"] for e in dead.values()} == {"audit_mismatch"}
    assert st.count(st.keys.done) == N - len(mixed)
    assert len(log_events(w.log_path, "audit_ok")) == N - len(mixed)
    code, text = audit(run, clean, redis_url)  # what stays done is right
    assert code == 0 and f"audited         {N - len(mixed)}" in text, text


@pytest.mark.parametrize("fmt", ["bf16", "fp8-e4m3"])
def test_compare_states_tolerates_last_bit_noise_and_catches_other_rows(fmt: str) -> None:
    """The bound in numbers: batched-forward noise (1e-3 relative, far above CPU fp32's)
    passes in both storage formats; another token's states fail. (Every encoding pair and
    the pre-norm state: tests/test_audit_encodings.py.)"""
    from types import SimpleNamespace

    from hsq import quant
    from hsq.closeness.rule import States, compare_states

    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(16, 3 * 64, generator=gen)
    last = torch.randn(16, 64, generator=gen)

    def stored(a: torch.Tensor, b: torch.Tensor) -> SimpleNamespace:
        if fmt == FP8:
            a = quant.dequantize(*quant.quantize(a, 3))
            b = quant.dequantize(*quant.quantize(b, 1))
        return SimpleNamespace(
            input_ids=torch.arange(16),
            metadata={quant.META_KEY: fmt},
            aux_hidden_states=a.to(torch.bfloat16),
            last_hidden_state=b.to(torch.bfloat16),
        )

    def fresh(a: torch.Tensor, b: torch.Tensor) -> States:
        return States({"aux_hidden_states": a, "last_hidden_state": b}, "plain")

    ids = list(range(16))
    kept = stored(aux, last)
    noisy = fresh(aux * (1 + 1e-3 * torch.randn(aux.shape, generator=gen)), last)
    assert compare_states(kept, ids, noisy).ok
    swapped = fresh(aux.roll(1, dims=0), last)  # token i holds token i-1's states
    verdict = compare_states(kept, ids, swapped)
    assert not verdict.ok and "aux_hidden_states" in verdict.detail
    assert not compare_states(kept, [*ids[:-1], 99], fresh(aux, last)).ok


# ---------------------------------------------------------------------------- expectations


def fp8_dump(srv: HostileServer, _call: int, ids: list[int], rid: str) -> None:
    """A dump quantized to fp8-e4m3 on the server, under a marker that says `plain`."""
    from hsq import quant

    states = tensors_for(ids)
    coded: dict[str, torch.Tensor] = {}
    for name, groups in state_tensors(len(LAYERS)):
        coded[name], coded[scale_name(name)] = quant.quantize(states[name], groups)
    shapes = expected_shapes(len(ids), len(LAYERS), HIDDEN, encoding=FP8)
    meta = replace(meta_for(ids, rid), encoding=FP8, tensors=shapes, format_version=0)
    write_dump(srv.dump_dir, srv.next_index(), meta, coded)


def prenorm_dump(srv: HostileServer, _call: int, ids: list[int], rid: str) -> None:
    states = tensors_for(ids)
    states[PRENORM_TENSOR] = states[LAST_TENSOR] * 3
    shapes = expected_shapes(len(ids), len(LAYERS), HIDDEN, prenorm=True)
    meta = replace(meta_for(ids, rid), prenorm=True, tensors=shapes, format_version=0)
    write_dump(srv.dump_dir, srv.next_index(), meta, states)


@pytest.mark.parametrize("case", ["fp8_dumps_in_a_bf16_run", "no_prenorm_in_a_prenorm_run"])
def test_the_audit_checks_each_dump_as_the_worker_does(
    tmp_path: Path, redis_url: str, case: str
) -> None:
    """`hsq audit` built its expectations without the run's store dtype and pre-norm state,
    so it took dumps the worker refuses (meta_mismatch): fp8-e4m3 values were compared as
    if they were states (every sample "mismatched", and --requeue threw good outputs
    away), and dumps without the pre-norm state passed as a match. It now checks with the
    worker's own expectations (RunView.expected): the server is refused, nothing changes.
    The server's marker claims what the run needs, so only the dumps' check can tell."""
    prenorm = case == "no_prenorm_in_a_prenorm_run"
    run = "xpre" if prenorm else "xfp8"
    srv = HostileServer(tmp_path / "dumps", prenorm_dump if prenorm else None)
    try:
        if prenorm:
            marker = ReadyMarker(tuple(LAYERS), IDENT, "hostile", "0", "0", 1, 0.0, prenorm=True)
            write_ready(srv.dump_dir, marker)
        ds = tmp_path / "data.jsonl"
        write_synthetic(ds, 4, seed=41, min_len=4, max_len=24)
        enqueue(ds, run, tmp_path / "out", redis_url, *(["--prenorm"] if prenorm else []))
        w = spawn_worker(run, srv.url, srv.dump_dir, redis_url, tmp_path / "w.log", "--burst")
        assert w.proc.wait(120) == 0, w.log_tail()
        st = store(redis_url, run)
        assert st.count(st.keys.done) == 4
        srv.writer = HostileServer.good if prenorm else fp8_dump
        res = hsq("audit", "--run", run, "--redis", redis_url, "--sample-fraction", "1",
                  "--server", srv.url, "--dump-dir", str(srv.dump_dir), "--no-progress",
                  "--requeue")  # fmt: skip
    finally:
        srv.stop()
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert "do not fit the run" in text, text
    assert ("pre-norm final state" if prenorm else "quantized this dump to fp8-e4m3") in text
    assert st.count(st.keys.done) == 4  # nothing requeued, no output removed


def test_an_audit_against_an_unreachable_server_fails_at_once_with_a_clear_message(
    tmp_path: Path, redis_url: str
) -> None:
    """Against a closed port the audit waited for a hook marker for 30
    minutes (`waiting_for_hook`, timeout_s 1800). Now: exit 2 naming the server, and
    nothing of the run changes. (The test's timeout is only a guard: the audit's own bound
    is its --request-timeout.)"""
    from hsq.node.procs import free_port

    run = "unreach"
    srv = HostileServer(tmp_path / "dumps")
    try:
        ds = tmp_path / "data.jsonl"
        write_synthetic(ds, 3, seed=43, min_len=4, max_len=12)
        enqueue(ds, run, tmp_path / "out", redis_url)
        w = spawn_worker(run, srv.url, srv.dump_dir, redis_url, tmp_path / "w.log", "--burst")
        assert w.proc.wait(120) == 0, w.log_tail()
    finally:
        srv.stop()
    st = store(redis_url, run)
    assert st.count(st.keys.done) == 3
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    res = hsq("audit", "--run", run, "--redis", redis_url, "--sample-fraction", "1",
              "--server", closed, "--dump-dir", str(tmp_path / "audit-dumps"),
              "--request-timeout", "30", "--requeue", "--no-progress")  # fmt: skip
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert f"the audit server {closed} cannot be reached" in text, text
    assert st.count(st.keys.done) == 3
