"""The SGLang dump hook's core on a CPU: plans, chunk accumulation, writing, filters.

SGLang itself never runs here. The tests drive the same objects the glue drives (plan,
capture, the writer thread) with synthetic batches, and every dump they expect is read
back through hsq.dump.read.read_dump and compared with the synthetic states.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hsq.dump.find import scan
from hsq.dump.read import read_meta
from hsq.dump.ready import READY_FILE, ReadyMarker, read_ready, write_ready
from hsq.engines.common import DumpContext
from hsq.engines.sglang import plugin
from hsq.engines.sglang.compat import PINNED_VERSIONS
from hsq.engines.sglang.config import HookConfig
from hsq.engines.sglang.dump_hook import batch_input_ids
from hsq.engines.sglang.dump_writer import DumpSink, HostCopier
from hsq.engines.sglang.launch_args import (
    check_launch_args,
    check_server_info,
    launch_command,
    refusals,
)
from hsq.engines.sglang.launch_sglang import check_running
from hsq.engines.sglang.layers import (
    check_effective,
    default_layer_ids,
    effective_layer_ids,
    find_capture_list,
    parse_layer_ids,
)
from hsq.engines.sglang.plan import RidFilter, build_plan
from hsq.errors import ConfigError
from hsq.states import AUX_TENSOR, LAST_TENSOR
from tests.helpers import hsq_process
from tests.support.fakesglang import (
    GOOD_ARGS,
    IDENT,
    LAYERS,
    Clock,
    FakeRunner,
    H,
    Req,
    Server,
    make_server,
    use_plugin,
)


@pytest.fixture
def server(tmp_path: Path) -> Any:
    srv = make_server(tmp_path)
    yield srv
    srv.hook.close()


# ---------------------------------------------------------------------------- batches


@pytest.mark.parametrize("packed", [True, False], ids=["packed-aux", "aux-list"])
def test_several_requests_in_one_batch(server: Server, packed: bool) -> None:
    a, b, c = server.add("hsq-a", 5), server.add("hsq-b", 1), server.add("hsq-c", 9)
    assert server.forward([(a, 0, 5), (b, 0, 1), (c, 0, 9)], packed=packed)
    dumps = server.dumps()
    assert sorted(dumps) == ["hsq-a", "hsq-b", "hsq-c"]
    assert all(d.meta.layer_ids == LAYERS for d in dumps.values())
    assert len({d.meta.request_index for d in dumps.values()}) == 3


def test_padded_rows_after_the_batch_are_ignored(server: Server) -> None:
    a = server.add("hsq-a", 6)
    assert server.forward([(a, 0, 6)], pad=10)  # a CUDA-graph bucket larger than the batch
    assert list(server.dumps()) == ["hsq-a"]


@pytest.mark.parametrize("packed", [True, False], ids=["packed-aux", "aux-list"])
def test_request_split_over_chunks(server: Server, packed: bool) -> None:
    long, short = server.add("hsq-long", 10), server.add("hsq-short", 3)
    assert server.forward([(long, 0, 4)], packed=packed)
    assert server.forward([(long, 4, 4)], packed=packed)
    server.hook.flush()
    assert scan(server.dump_dir).complete == []  # nothing before the last chunk
    # The last chunk shares its forward with another request, as chunked prefill does.
    assert server.forward([(long, 8, 2), (short, 0, 3)], packed=packed)
    dumps = server.dumps()
    assert sorted(dumps) == ["hsq-long", "hsq-short"]
    assert dumps["hsq-long"].meta.num_tokens == 10


def test_tp_rank_other_than_0_writes_nothing(tmp_path: Path) -> None:
    srv = make_server(tmp_path, rank=1)
    a = srv.add("hsq-a", 4)
    assert srv.hook.plan([a], [0], [4]) is None
    assert not srv.forward([(a, 0, 4)])
    srv.hook.flush()
    assert srv.hook.sink is None
    assert not srv.dump_dir.exists() or list(srv.dump_dir.iterdir()) == []


def test_aborted_request_is_evicted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    srv = make_server(tmp_path, clock=clock, evict_after_s=30.0)
    caplog.set_level(logging.WARNING, logger="hsq.sglang_hook")
    try:
        gone, later = srv.add("hsq-gone", 10), srv.add("hsq-later", 2)
        srv.forward([(gone, 0, 4)])  # its remaining chunks never come (aborted)
        srv.hook.flush()
        assert srv.hook.sink is not None
        assert srv.hook.sink.acc.open_rids == ["hsq-gone"]
        clock.now += 31
        srv.forward([(later, 0, 2)])
        assert list(srv.dumps()) == ["hsq-later"]
        assert srv.hook.sink.acc.open_rids == []
        assert srv.hook.sink.acc.evicted == 1
        assert "evicted unfinished request hsq-gone" in caplog.text
    finally:
        srv.hook.close()


@pytest.mark.parametrize(
    "chunks",
    [
        [(4, 4), (0, 4)],  # out of order: the second chunk first
        [(0, 4), (6, 2)],  # a gap: tokens 4..5 never computed (radix hit / lost chunk)
        [(0, 4), (0, 4), (4, 4)],  # a chunk repeated
    ],
    ids=["out-of-order", "gap", "repeat"],
)
def test_broken_chunk_order_writes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, chunks: list[tuple[int, int]]
) -> None:
    srv = make_server(tmp_path)
    caplog.set_level(logging.ERROR, logger="hsq.sglang_hook")
    try:
        req = srv.add("hsq-x", 8)
        for pre, ext in chunks:
            srv.forward([(req, pre, ext)])
        srv.hook.flush()
        assert scan(srv.dump_dir).complete == [] and scan(srv.dump_dir).pending == []
        assert srv.hook.sink is not None and srv.hook.sink.acc.broken == 1
        assert "hsq-x is broken" in caplog.text
    finally:
        srv.hook.close()


def test_warmup_and_health_check_rids_are_skipped(tmp_path: Path) -> None:
    srv = make_server(tmp_path, rid_prefix="hsq-")
    try:
        health = Req("HEALTH_CHECK_3f2a", [0])
        warmup = Req("0123456789abcdef0123456789abcdef", [10, 11, 12])  # uuid4().hex
        other = Req("someone-else-1", [1, 2])
        mine = srv.add("hsq-1", 4)
        assert srv.hook.plan([health], [0], [1]) is None
        assert srv.forward([(warmup, 0, 3), (health, 0, 1), (other, 0, 2), (mine, 0, 4)])
        assert list(srv.dumps()) == ["hsq-1"]
    finally:
        srv.hook.close()


def test_rid_filter_without_prefix() -> None:
    f = RidFilter()
    assert f.wants("anything") and f.wants("hsq-1")
    assert not f.wants("HEALTH_CHECK_123") and not f.wants("f" * 32)


def test_plan_rows_and_skips() -> None:
    reqs = [Req("a", [1] * 5), Req("b", [1] * 3), Req("c", [1] * 4), Req("d", [1] * 2)]
    # b was aborted before the forward; d is a decode row of a mixed batch (past its prompt)
    plan = build_plan(
        reqs, [0, 0, 2, 2], [5, 3, 2, 1], RidFilter(), skip=[False, True] + [False] * 2
    )
    assert plan is not None
    assert [(e.rid, e.row_offset, e.prefix_len, e.extend_len) for e in plan.entries] == [
        ("a", 0, 0, 5),
        ("c", 8, 2, 2),
    ]
    assert plan.num_rows == 11
    assert plan.entries[1].is_last


def test_rows_that_do_not_fit_the_plan_are_not_captured(server: Server) -> None:
    a = server.add("hsq-a", 4)
    plan = server.hook.plan([a], [0], [4])
    assert plan is not None
    s = server.states["hsq-a"]
    ids = torch.tensor(s.ids)
    assert not server.hook.capture(plan, ids[:3], s.last[:3], s.aux[:3])  # too few rows
    assert not server.hook.capture(plan, ids, s.last, s.aux[:, :H])  # one layer, not three
    assert not server.hook.capture(plan, ids, s.last, None)  # aux capture off
    assert server.dumps() == {}
    assert server.hook.skipped_batches == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "cfg",
    [{}, {"device_staging": True}, {"encoding": "fp8-e4m3", "prenorm": True}],
    ids=["plain", "device-staging", "fp8-prenorm"],
)
def test_cuda_copies_are_pinned_async_and_exact(tmp_path: Path, cfg: dict[str, Any]) -> None:
    """The GPU path: side-stream copies into pinned memory, then the states are
    overwritten in place on the compute stream (as a reused CUDA-graph buffer would be);
    the dump must still hold the values at capture time, whether the next forward waited
    for the host copy (plain) or the copy reads the hook's own device tensors (staged
    clones, fp8 values)."""
    server = make_server(tmp_path, **cfg)
    a, b = server.add("hsq-a", 300), server.add("hsq-b", 1000)
    plan = server.hook.plan([a, b], [0, 0], [300, 1000])
    assert plan is not None
    s_a, s_b = server.states["hsq-a"], server.states["hsq-b"]
    ids = torch.tensor(s_a.ids + s_b.ids, device="cuda")
    hidden = torch.cat([s_a.last, s_b.last]).cuda()
    aux = [torch.cat([s_a.aux, s_b.aux])[:, j * H : (j + 1) * H].cuda() for j in range(3)]
    pre = torch.cat([s_a.pre, s_b.pre]).cuda()
    torch.cuda.synchronize()
    try:
        assert server.hook.capture(plan, ids, hidden, aux, pre if server.hook.cfg.prenorm else None)
        for t in (hidden, pre, *aux):
            t.fill_(float("nan"))
        ids.fill_(0)
        assert sorted(server.dumps()) == ["hsq-a", "hsq-b"]
        host, ready = HostCopier().copy([hidden])
        assert host[0].is_pinned() and ready is not None
    finally:
        server.hook.close()


# ---------------------------------------------------------------------------- writer


class Gate:
    """Stands in for a CUDA event: the writer waits on it before touching the copies."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def synchronize(self) -> None:
        self.open.wait(10)


def test_full_queue_blocks_the_scheduler(tmp_path: Path) -> None:
    sink = DumpSink(tmp_path / "d", DumpContext(IDENT, LAYERS), max_items=1)
    srv = make_server(tmp_path)
    req = srv.add("hsq-a", 2)
    plan = srv.hook.plan([req], [0], [2])
    assert plan is not None
    from hsq.engines.sglang.accumulator import Chunk

    s = srv.states["hsq-a"]
    chunk = Chunk(
        plan.entries[0], torch.tensor(s.ids), {AUX_TENSOR: [s.aux], LAST_TENSOR: [s.last]}
    )
    gate = Gate()
    sink.submit([chunk], gate)  # taken by the writer, which waits on the gate
    sink.submit([chunk], None)  # queued: the queue is now full
    third = threading.Thread(target=sink.submit, args=([chunk], None))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # backpressure: the scheduler thread waits
    gate.open.set()
    third.join(5)
    assert not third.is_alive()
    sink.flush()
    assert len(sink.written) == 3  # a rid reused after completion is a new request
    sink.close()
    srv.hook.close()


def test_restarted_writer_does_not_reuse_indices(tmp_path: Path) -> None:
    srv = make_server(tmp_path)
    a = srv.add("hsq-a", 2)
    srv.forward([(a, 0, 2)])
    srv.hook.flush()
    srv.hook.close()
    again = make_server(tmp_path)
    again.states = srv.states
    again.forward([(a, 0, 2)])
    again.hook.flush()
    again.hook.close()
    assert [p.name for p in scan(srv.dump_dir).complete] == ["req_0", "req_1"]


# ---------------------------------------------------------------------------- layers


@pytest.mark.parametrize(
    ("ids", "want"),
    [(None, [2, 16, 29]), ([2, 15, 28], [3, 16, 29]), ([1, 15, 28], [2, 16, 29]), ([0], [1])],
)
def test_llama_layer_convention(ids: list[int] | None, want: list[int]) -> None:
    assert effective_layer_ids("llama", 32, ids) == want


@pytest.mark.parametrize(
    ("ids", "rule", "want"),
    [
        (None, True, [2, 30, 58]),  # Kimi-K2.5: L=61
        ([2, 30, 58], True, [2, 30, 58]),  # first id is not 1: as given
        ([1, 29, 57], True, [2, 30, 58]),  # first id is 1: +1
        ([2, 30, 58], False, [3, 31, 59]),  # sglang < 0.5.13: always +1
    ],
)
def test_deepseek_layer_convention(ids: list[int] | None, rule: bool, want: list[int]) -> None:
    assert effective_layer_ids("deepseek", 61, ids, deepseek_first_id_rule=rule) == want


def test_layer_ids_parse_and_range() -> None:
    assert parse_layer_ids("2,30, 58") == (2, 30, 58)
    assert parse_layer_ids("") is None and parse_layer_ids("default") is None
    assert default_layer_ids(61) == [2, 30, 58]
    with pytest.raises(ValueError):
        parse_layer_ids("2,x")
    with pytest.raises(ValueError):
        effective_layer_ids("llama", 4, [5])


def test_find_capture_list_on_text_and_wrapped_models() -> None:
    text = SimpleNamespace(model=SimpleNamespace(layers_to_capture=[3, 16, 29]))
    kimi = SimpleNamespace(language_model=SimpleNamespace(model=text.model))
    assert find_capture_list(text) == [3, 16, 29]
    assert find_capture_list(kimi) == [3, 16, 29]
    assert find_capture_list(SimpleNamespace(model=SimpleNamespace(layers_to_capture=[]))) is None


# ---------------------------------------------------------------------------- glue


def test_glue_hands_the_plan_to_the_logits_call(server: Server) -> None:
    """plugin.around_run_batch -> (forward) -> plugin.around_logits, as SGLang nests them."""
    a, b = server.add("hsq-a", 3), server.add("hsq-b", 4)
    s_a, s_b = server.states["hsq-a"], server.states["hsq-b"]
    ids = torch.tensor(s_a.ids + s_b.ids)
    hidden = torch.cat([s_a.last, s_b.last])
    aux = torch.cat([s_a.aux, s_b.aux])
    calls: list[str] = []

    def logits_forward(_proc: object, *_args: Any, **_kwargs: Any) -> str:
        calls.append("logits")
        return "logits-output"

    def run_batch(_sched: object, _batch: object) -> str:
        # The target model's logits call, then a second one (a draft model) sees no plan.
        out = plugin.around_logits(logits_forward, None, ids, hidden, None, None, aux)
        plugin.around_logits(logits_forward, None, ids, hidden, None, None, None)
        return str(out)

    batch = SimpleNamespace(
        reqs=[a, b],
        prefix_lens=[0, 0],
        extend_lens=[3, 4],
        forward_mode=SimpleNamespace(name="EXTEND"),
    )
    decode = SimpleNamespace(reqs=[a], forward_mode=SimpleNamespace(name="DECODE"))
    old = plugin._hook
    plugin._hook = server.hook
    try:
        assert plugin.around_run_batch(run_batch, None, batch) == "logits-output"
        assert plugin.around_run_batch(lambda _s, _b: "decoded", None, decode) == "decoded"
    finally:
        plugin._hook = old
    assert calls == ["logits", "logits"]
    assert sorted(server.dumps()) == ["hsq-a", "hsq-b"]
    assert server.hook.skipped_batches == 0


def test_config_from_env() -> None:
    assert HookConfig.from_env({}) is None
    cfg = HookConfig.from_env(
        {"SGLANG_HS_DUMP_DIR": "/d", "SGLANG_HS_LAYER_IDS": "1,2", "SGLANG_HS_QUEUE_MB": "64"}
    )
    assert cfg is not None and cfg.layer_ids == (1, 2) and cfg.queue_bytes == 64 << 20
    assert HookConfig.from_env(cfg.to_env()) == HookConfig(Path("/d"), (1, 2))
    with pytest.raises(ValueError, match="SGLANG_HS_LAYERS"):
        HookConfig.from_env({"SGLANG_HS_DUMP_DIR": "/d", "SGLANG_HS_LAYERS": "1"})


# ---------------------------------------------------------------------------- CLI helpers


def test_launch_command_picks_plugin_or_launcher() -> None:
    new = launch_command("/m/llama", "/dumps", sglang_version="0.5.23", layer_ids=[1, 15, 28])
    assert new[:4] == [
        "env",
        "SGLANG_HS_DUMP_DIR=/dumps",
        "SGLANG_HS_LAYER_IDS=1,15,28",
        ("SGLANG_HS_RID_PREFIX=hsq-"),
    ]
    assert new[5:7] == ["-m", "sglang.launch_server"]
    assert "--disable-radix-cache" in new and "--disable-prefill-cuda-graph" in new
    old = launch_command("/m/llama", "/dumps", sglang_version="0.5.9", overlap_schedule=False)
    assert "hsq.engines.sglang.legacy_launch" in old and "--disable-overlap-schedule" in old
    assert "--disable-piecewise-cuda-graph" in launch_command("m", "d", sglang_version="0.5.11")
    with pytest.raises(ValueError, match="dp-attention"):
        launch_command("m", "d", sglang_version="0.5.23", extra_args=["--enable-dp-attention"])
    assert check_launch_args(["--dp-size", "2"]) and not check_launch_args(["--dp-size", "1"])


def test_check_server_info() -> None:
    good = {
        "disable_radix_cache": True,
        "chunked_prefill_size": 8192,
        "dp_size": 1,
        "tp_size": 8,
        "disable_prefill_cuda_graph": True,
        "version": PINNED_VERSIONS[0],
    }
    assert check_server_info(good) == []
    bad = check_server_info(
        {
            **good,
            "disable_radix_cache": False,
            "chunked_prefill_size": 256,
            "dp_size": 2,
            "disable_prefill_cuda_graph": False,
            "version": "0.4.0",
        }
    )
    assert len(bad) == 5
    assert any("radix" in p for p in bad) and any("chunked_prefill_size 256" in p for p in bad)
    assert check_server_info({**good, "chunked_prefill_size": -1}) == []


def test_launcher_refuses_without_radix_cache_off(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hsq.engines.sglang.legacy_launch", "--model-path", "m"],
        capture_output=True,
        text=True,
        env={"SGLANG_HS_DUMP_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--disable-radix-cache is required" in proc.stderr


_SPAWN_PROBE = """
import multiprocessing as mp, os, sys
if __name__ in ("__main__", "__mp_main__"):
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(__name__ + "\\n")
def child():
    pass
if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child)
    p.start(); p.join(); sys.exit(p.exitcode)
"""


def test_spawn_reruns_a_dash_m_module_in_children(tmp_path: Path) -> None:
    """The mechanism legacy_launch.py relies on: spawn re-runs `python -m pkg.mod`'s top level
    (as __mp_main__) in each child before it runs the target."""
    pkg = tmp_path / "probepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch.py").write_text(_SPAWN_PROBE)
    out = tmp_path / "out.txt"
    subprocess.run(
        [sys.executable, "-m", "probepkg.launch"],
        cwd=tmp_path,
        env={"PROBE_OUT": str(out), "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=60,
    )
    assert out.read_text().split() == ["__main__", "__mp_main__"]


# ---------------------------------------------------------------------------- concurrency


def rids_dumped(dump_dir: Path) -> Counter[str]:
    return Counter(read_meta(p).rid for p in scan(dump_dir).complete)


def test_k_concurrent_requests_in_one_batch_give_one_dump_per_rid(server: Server) -> None:
    """K requests in flight land in one prefill batch; each gets its own dump."""
    reqs = [server.add(f"hsq-k{i}", n) for i, n in enumerate([1, 7, 64, 3, 128, 2, 31, 16])]
    assert server.forward([(r, 0, len(r.origin_input_ids)) for r in reqs])
    dumps = server.dumps()  # each read back and compared with its own states
    assert rids_dumped(server.dump_dir) == Counter({r.rid: 1 for r in reqs})
    assert sorted(dumps) == sorted(r.rid for r in reqs)


@pytest.mark.parametrize("packed", [True, False], ids=["packed-aux", "aux-list"])
def test_chunked_request_while_others_run_gives_one_dump_per_rid(
    server: Server, packed: bool
) -> None:
    """A long request split by chunked prefill (chunk 8) shares each forward with other
    requests that start, finish, or decode meanwhile, as SGLang's mixed batches do."""
    long = server.add("hsq-long", 20)
    a, b, c, d = (server.add(f"hsq-{x}", n) for x, n in zip("abcd", [5, 3, 6, 4], strict=True))
    # forward 1: a whole, the first 3 of long (chunk budget 8)
    assert server.forward([(a, 0, 5), (long, 0, 3)], packed=packed)
    # forward 2: a decodes (one row past its prompt), long continues, b whole
    assert server.forward([(a, 5, 1), (long, 3, 5), (b, 0, 3)], packed=packed)
    # forward 3: long continues alone with c's first half
    assert server.forward([(long, 8, 8), (c, 0, 3)], packed=packed)
    server.hook.flush()
    assert "hsq-long" not in rids_dumped(server.dump_dir)  # not before its last chunk
    # forward 4: c finishes, long finishes, d whole, b decodes
    assert server.forward([(c, 3, 3), (long, 16, 4), (b, 3, 1), (d, 0, 4)], packed=packed)
    dumps = server.dumps()
    assert rids_dumped(server.dump_dir) == Counter(
        {"hsq-long": 1, "hsq-a": 1, "hsq-b": 1, "hsq-c": 1, "hsq-d": 1}
    )
    assert dumps["hsq-long"].meta.num_tokens == 20 and dumps["hsq-c"].meta.num_tokens == 6


# ---------------------------------------------------------------------------- Kimi-K2.5


def kimi_logits_call(
    server: Server, batch: list[tuple[Req, int, int]], *, metadata_ids: bool = True
) -> list[tuple[Any, ...]]:
    """Run one prefill batch through the glue with the logits call exactly as
    DeepseekV2ForCausalLM.forward makes it under KimiK25ForConditionalGeneration:
    ``self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch,
    aux_hidden_states)`` with input_ids None (general_mm_embed_routine passes
    ``input_ids=None``), the ForwardBatch holding the ids, and one packed aux tensor."""
    ids, hidden, aux = [], [], []
    for r, p, e in batch:
        s = server.states[r.rid]
        ids.append(torch.tensor(s.ids[p : p + e], dtype=torch.int64))
        hidden.append(s.last[p : p + e])
        aux.append(s.aux[p : p + e])
    forward_batch = SimpleNamespace(
        input_ids=torch.cat(ids) if metadata_ids else None,
        forward_mode=SimpleNamespace(name="EXTEND"),
    )
    seen: list[tuple[Any, ...]] = []

    def logits_forward(_proc: object, *args: Any, **_kwargs: Any) -> str:
        seen.append(args)
        return "logits"

    def run_batch(_sched: object, _b: object) -> object:
        lm_head = object()
        return plugin.around_logits(
            logits_forward, None, None, torch.cat(hidden), lm_head, forward_batch, torch.cat(aux)
        )

    batch_obj = SimpleNamespace(
        reqs=[r for r, _, _ in batch],
        prefix_lens=[p for _, p, _ in batch],
        extend_lens=[e for _, _, e in batch],
        forward_mode=SimpleNamespace(name="EXTEND"),
    )
    old = plugin._hook
    plugin._hook = server.hook
    try:
        assert plugin.around_run_batch(run_batch, None, batch_obj) == "logits"
    finally:
        plugin._hook = old
    return seen


def test_kimi_call_shape_input_ids_none_takes_ids_from_the_forward_batch(server: Server) -> None:
    a, b = server.add("hsq-kimi-a", 9), server.add("hsq-kimi-b", 4)
    seen = kimi_logits_call(server, [(a, 0, 9), (b, 0, 4)])
    assert seen[0][0] is None  # the original logits call still gets input_ids=None
    dumps = server.dumps()  # fingerprints are checked against the prompts' ids
    assert sorted(dumps) == ["hsq-kimi-a", "hsq-kimi-b"]
    assert server.hook.skipped_batches == 0


def test_kimi_call_shape_chunked(server: Server) -> None:
    long = server.add("hsq-kimi-long", 12)
    kimi_logits_call(server, [(long, 0, 8)])
    kimi_logits_call(server, [(long, 8, 4)])
    assert list(server.dumps()) == ["hsq-kimi-long"]


def test_no_input_ids_anywhere_is_not_captured(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="hsq.sglang_hook")
    a = server.add("hsq-a", 3)
    kimi_logits_call(server, [(a, 0, 3)], metadata_ids=False)
    assert server.dumps() == {} and server.hook.skipped_batches == 1
    assert "no input ids" in caplog.text


def test_batch_input_ids_prefers_the_call_argument() -> None:
    ids, other = torch.tensor([1, 2]), torch.tensor([3, 4])
    assert batch_input_ids(ids, SimpleNamespace(input_ids=other)) is ids
    assert batch_input_ids(None, SimpleNamespace(input_ids=other)) is other
    assert batch_input_ids(None, SimpleNamespace()) is None
    assert batch_input_ids(None, SimpleNamespace(input_ids=[3, 4])) is None  # not a tensor


# ---------------------------------------------------------------------------- refusals

REFUSED: list[tuple[str, Any, str]] = [
    ("enable_two_batch_overlap", True, "two-batch-overlap"),
    ("moe_a2a_backend", "deepep", "moe-a2a-backend deepep"),
    ("moe_dense_tp_size", 1, "moe-dense-tp-size 1"),
    ("cuda_graph_backend_prefill", "breakable", "cuda-graph-backend-prefill breakable"),
    ("cuda_graph_backend_prefill", "full", "overrides --disable-prefill-cuda-graph"),
    ("enable_prefill_cp", True, "prefill context parallelism"),
    ("enable_prefill_context_parallel", True, "prefill context parallelism"),
    ("attn_cp_size", 2, "prefill context parallelism"),
    ("attn_dp_size", 8, "DP attention"),
    ("enable_dp_attention", True, "DP attention"),
    ("dp_size", 2, "--dp-size"),
    ("pp_size", 2, "pipeline"),
    ("enable_layernorm_sp", True, "layernorm-sp"),
    ("disable_radix_cache", False, "radix cache"),
    ("disable_prefill_cuda_graph", False, "prefill CUDA graphs are on"),
    ("disable_piecewise_cuda_graph", False, "prefill CUDA graphs are on"),
    ("speculative_algorithm", "EAGLE3", "speculative decoding"),
    ("enable_return_hidden_states", True, "return-hidden-states"),
]


def test_good_settings_are_not_refused() -> None:
    assert refusals(GOOD_ARGS) == []
    assert refusals({**GOOD_ARGS, "moe_dense_tp_size": 8}) == []  # = tp_size: no sharding
    assert refusals({**GOOD_ARGS, "cuda_graph_backend_prefill": "disabled"}) == []
    # Untrusted /server_info values never raise.
    assert refusals({**GOOD_ARGS, "dp_size": "two", "pp_size": None}) == []


@pytest.mark.parametrize(("key", "value", "says"), REFUSED, ids=[f"{k}={v}" for k, v, _ in REFUSED])
def test_each_refusal_in_the_plugin_and_server_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, value: Any, says: str
) -> None:
    bad = {**GOOD_ARGS, key: value}
    problems = refusals(bad)
    assert len(problems) == 1 and says in problems[0]
    info = {**bad, "chunked_prefill_size": 8192, "version": PINNED_VERSIONS[0]}
    assert check_server_info(info) == problems  # what `hsq launch-sglang` checks
    # The plugin refuses before the weights load, whatever launched the server.
    runner = FakeRunner.kimi(tmp_path, server_args=SimpleNamespace(**bad))
    use_plugin(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match="refusing to start") as err:
        plugin.around_load_model(runner.load, runner)
    assert says in str(err.value)
    assert runner.loads == 0


def test_the_plugin_reads_resolved_settings_when_sglang_has_them() -> None:
    """0.5.2x resolves lazily: the raw attribute may say off while the resolved value is
    on (and the other way round); the plugin reads what /server_info reports."""

    class Args:
        enable_two_batch_overlap = False

        def resolved_dict(self) -> dict[str, Any]:
            return {**GOOD_ARGS, "enable_two_batch_overlap": True}

    values = plugin.server_arg_values(Args())
    assert values["enable_two_batch_overlap"] is True
    raw = plugin.server_arg_values(SimpleNamespace(**GOOD_ARGS, unrelated=1))
    assert raw == GOOD_ARGS


@pytest.mark.parametrize(
    "argv",
    [
        ["--enable-two-batch-overlap"],
        ["--moe-a2a-backend", "deepep"],
        ["--cuda-graph-backend-prefill", "breakable"],
        ["--attn-dp-size", "4"],
        ["--enable-prefill-cp"],
        ["--chunked-prefill-size", "512"],
        ["--chunked-prefill-size=256"],
        ["--chunked-prefill-size", "lots"],
        ["--dp-size=2"],
    ],
)
def test_launch_args_refusals(argv: list[str]) -> None:
    assert check_launch_args(argv), argv


@pytest.mark.parametrize(
    "argv",
    [
        ["--moe-a2a-backend", "none", "--dp-size", "1"],
        ["--cuda-graph-backend-prefill", "disabled"],
        ["--chunked-prefill-size", "1024"],
        ["--chunked-prefill-size", "-1"],
    ],
)
def test_launch_args_accepted(argv: list[str]) -> None:
    assert not check_launch_args(argv)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"SGLANG_HS_LAYER_IDS": "2,2,58"}, "must not repeat"),
        ({"SGLANG_HS_LAYER_IDS": "2,x"}, "integers"),
        ({"SGLANG_HS_LAYERS": "2"}, "unknown settings"),
        ({"SGLANG_HS_QUEUE_ITEMS": "0"}, "positive"),
    ],
)
def test_register_turns_bad_settings_into_system_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], says: str
) -> None:
    """SGLang's load_plugins() catches Exception from a plugin and only logs it; a
    SystemExit is not an Exception, so the server stops with the message."""
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match=says) as err:
        plugin.register()
    assert not isinstance(err.value, Exception)


# ---------------------------------------------------------------------------- load + marker


@pytest.mark.parametrize(
    ("ids", "want"),
    [(None, (2, 30, 58)), ("3,31,59", (3, 31, 59)), ("1,29,57", (2, 30, 58))],
    ids=["unset", "3,31,59", "1,29,57"],
)
def test_kimi_load_writes_the_readiness_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ids: str | None, want: tuple[int, ...]
) -> None:
    """docs/sglang.md's Kimi-K2.5 worked example (61 layers), through the load hook."""
    dump_dir = use_plugin(monkeypatch, tmp_path, layer_ids=ids)
    dump_dir.mkdir()
    write_ready(dump_dir, ReadyMarker((9,), IDENT, "sglang", "0.5.15", "0", 1, 0.0))  # stale
    runner = FakeRunner.kimi(tmp_path)
    try:
        assert plugin.around_load_model(runner.load, runner) == "loaded"
        assert runner.loads == 1 and runner.marker_at_load is False  # stale one removed first
        marker = read_ready(dump_dir)
        assert marker is not None and marker.layer_ids == want
        assert marker.server == "sglang" and marker.server_version == "0.5.23"
        assert marker.model.architecture == "KimiK25ForConditionalGeneration"
        assert marker.model.num_layers == 61 and marker.pid == os.getpid()
        assert plugin._hook is not None and plugin._hook.ctx.layer_ids == list(want)
    finally:
        if plugin._hook is not None:
            plugin._hook.close()


@pytest.mark.parametrize("ids", ["3,31,61", "2,30,70"], ids=["id-L", "past-L"])
def test_layer_id_at_or_past_l_is_refused_before_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ids: str
) -> None:
    use_plugin(monkeypatch, tmp_path, layer_ids=ids)
    runner = FakeRunner.kimi(tmp_path)
    with pytest.raises(ConfigError, match=r"out of range.*61 is never captured"):
        plugin.around_load_model(runner.load, runner)
    assert runner.loads == 0


def test_predicted_and_effective_layers_differ_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A known family whose model applies another rule (a changed SGLang) is refused."""
    use_plugin(monkeypatch, tmp_path, layer_ids="3,31,59")
    runner = FakeRunner.kimi(tmp_path, rule=lambda ids: [i + 1 for i in ids])
    with pytest.raises(ConfigError, match=r"expected layers \[3, 31, 59\].*\[4, 32, 60\]"):
        plugin.around_load_model(runner.load, runner)
    assert not (tmp_path / "dumps" / READY_FILE).exists()


def test_model_capturing_a_layer_twice_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_plugin(monkeypatch, tmp_path)
    runner = FakeRunner.kimi(tmp_path, rule=lambda _ids: [2, 30, 30])
    with pytest.raises(ConfigError, match="twice"):
        plugin.around_load_model(runner.load, runner)


def test_non_writer_rank_writes_no_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dump_dir = use_plugin(monkeypatch, tmp_path, rank=1)
    runner = FakeRunner.kimi(tmp_path)
    plugin.around_load_model(runner.load, runner)
    assert not (dump_dir / READY_FILE).exists()


def test_hook_off_or_draft_runner_just_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SGLANG_HS_DUMP_DIR", raising=False)
    runner = FakeRunner.kimi(tmp_path, server_args=SimpleNamespace(disable_radix_cache=False))
    assert plugin.around_load_model(runner.load, runner) == "loaded"
    use_plugin(monkeypatch, tmp_path)
    runner.is_draft_worker = True
    assert plugin.around_load_model(runner.load, runner) == "loaded"
    assert runner.loads == 2 and not (tmp_path / "dumps").exists()


@pytest.mark.parametrize(
    ("fam", "n", "ids"),
    [
        ("deepseek", 61, [3, 31, 61]),  # id L: SGLang never captures it
        ("llama", 32, [2, 15, 31]),  # 31 + 1 = L
        ("llama", 4, None),  # default [2, 2, 1] collides
    ],
)
def test_layer_ids_at_l_or_colliding_are_refused(fam: Any, n: int, ids: list[int] | None) -> None:
    with pytest.raises(ValueError):
        effective_layer_ids(fam, n, ids)


def test_duplicate_layer_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="repeat"):
        parse_layer_ids("2,30,30")
    with pytest.raises(ValueError, match="twice"):
        effective_layer_ids("deepseek", 61, [2, 30, 30])
    with pytest.raises(ValueError, match="twice"):
        check_effective([5, 5], 61)
    check_effective([0, 60], 61)


def test_launch_sglang_checks_the_marker(tmp_path: Path) -> None:
    """`hsq launch-sglang`'s check of a healthy server: /server_info and the marker."""
    info = {**GOOD_ARGS, "chunked_prefill_size": 8192, "version": PINNED_VERSIONS[0]}
    problems, marker = check_running(info, tmp_path)
    assert marker is None and len(problems) == 1 and "hook is not active" in problems[0]
    write_ready(tmp_path, ReadyMarker((2, 30, 58), IDENT, "sglang", "0.5.23", "0.1.0", 7, 1.0))
    problems, marker = check_running(info, tmp_path)
    assert problems == [] and marker is not None and marker.layer_ids == (2, 30, 58)
    problems, _ = check_running({**info, "enable_two_batch_overlap": True}, tmp_path)
    assert len(problems) == 1
    (tmp_path / READY_FILE).write_text("{}")
    problems, marker = check_running(info, tmp_path)
    assert marker is None and "keys" in problems[0]
    assert check_running([], tmp_path)[0][0] == "/server_info is not an object"


def test_launcher_refuses_bad_settings_with_a_message(tmp_path: Path) -> None:
    """The < 0.5.11 path: install_patches() stops on the same settings as register()."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hsq.engines.sglang.legacy_launch",
            "--model-path",
            "m",
            "--disable-radix-cache",
        ],
        capture_output=True,
        text=True,
        env={
            "SGLANG_HS_DUMP_DIR": str(tmp_path),
            "SGLANG_HS_LAYER_IDS": "2,2",
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        },
        timeout=60,
    )
    assert proc.returncode == 1
    assert "hs_dump: refusing to start: layer ids must not repeat" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--chunked-prefill-size", "512"], "--chunked-prefill-size 512"),
        (["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
        (["--layers", "1,3,9"], "out of range for a model of 8 layers"),
    ],
)
@pytest.mark.realproc
def test_launch_sglang_refuses_before_starting_anything(
    tmp_path: Path, extra: list[str], says: str
) -> None:
    """What the launcher can judge from its command line and a local config.json
    is refused before SGLang starts (a live start costs minutes). SGLang is not installed
    here, so a launcher that tried to start it would fail differently, later."""
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8})
    )
    proc = hsq_process(
        "launch-sglang",
        "--model-path",
        str(model),
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--sglang-version",
        "0.5.15",
        *extra,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stdout + proc.stderr
    assert "sglang.launch_server" not in proc.stdout  # the command was never even printed
    assert not (tmp_path / "dumps").exists()
