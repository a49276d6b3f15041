"""The SGLang dump hook's core on a CPU: plans, chunk accumulation, writing, filters.

SGLang itself never runs here. The tests drive the same objects the glue drives (plan,
capture, the writer thread) with synthetic batches, and every dump they expect is read
back through hsq.protocol.read_dump and compared with the synthetic states.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hsq.protocol import Dump, Expected, fingerprint, read_dump, read_meta, scan
from sglang_server.sglang_hook import plugin
from sglang_server.sglang_hook.cli import check_launch_args, check_server_info, launch_command
from sglang_server.sglang_hook.compat import PINNED_VERSIONS
from sglang_server.sglang_hook.config import HookConfig
from sglang_server.sglang_hook.identity import model_identity
from sglang_server.sglang_hook.layers import (
    default_layer_ids,
    effective_layer_ids,
    find_capture_list,
    parse_layer_ids,
)
from sglang_server.sglang_hook.plan import RidFilter, build_plan
from sglang_server.sglang_hook.sink import DumpContext, DumpSink, HostCopier
from sglang_server.sglang_hook.tap import DumpHook, batch_input_ids

H = 8
LAYERS = [3, 6, 9]
IDENT = model_identity("/models/tiny-llama/", "LlamaForCausalLM", 12, H, {"hidden_size": H})


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]


@dataclass
class States:
    """One request's whole-prompt states, as the model would compute them."""

    ids: list[int]
    aux: torch.Tensor  # [T, k*H]
    last: torch.Tensor  # [T, H]


def states_for(n: int, seed: int) -> States:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32000, (n,), generator=g).tolist()
    aux = torch.randn(n, len(LAYERS) * H, generator=g).to(torch.bfloat16)
    last = torch.randn(n, H, generator=g).to(torch.bfloat16)
    return States(ids, aux, last)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Server:
    """A DumpHook plus the synthetic model behind it."""

    hook: DumpHook
    dump_dir: Path
    states: dict[str, States] = field(default_factory=dict)

    def add(self, rid: str, n: int) -> Req:
        self.states[rid] = states_for(n, seed=len(self.states) + 1)
        return Req(rid, list(self.states[rid].ids))

    def forward(
        self, batch: list[tuple[Req, int, int]], *, packed: bool = True, pad: int = 0
    ) -> bool:
        """Plan and capture one prefill forward of (request, prefix_len, extend_len)."""
        reqs = [r for r, _, _ in batch]
        plan = self.hook.plan(reqs, [p for _, p, _ in batch], [e for _, _, e in batch])
        if plan is None:
            return False
        ids, aux, last = [], [], []
        for r, p, e in batch:
            s = self.states.get(r.rid) or states_for(len(r.origin_input_ids), seed=99)
            # Rows past the prompt (a decode row of a mixed batch) are not prompt states.
            tail = max(0, p + e - len(s.ids))
            ids.append(torch.tensor(s.ids[p : p + e] + [7] * tail, dtype=torch.int64))
            aux.append(
                torch.cat(
                    [s.aux[p : p + e], torch.ones(tail, len(LAYERS) * H, dtype=torch.bfloat16)]
                )
            )
            last.append(torch.cat([s.last[p : p + e], torch.ones(tail, H, dtype=torch.bfloat16)]))
        input_ids = torch.cat([*ids, torch.zeros(pad, dtype=torch.int64)])
        hidden = torch.cat([*last, torch.zeros(pad, H, dtype=torch.bfloat16)])
        packed_aux = torch.cat([*aux, torch.zeros(pad, len(LAYERS) * H, dtype=torch.bfloat16)])
        # Llama passes a list of k [T, H] tensors (cloned by SGLang), DeepSeek one packed.
        per_layer = [packed_aux[:, j * H : (j + 1) * H].clone() for j in range(len(LAYERS))]
        aux_arg: Any = packed_aux if packed else per_layer
        return self.hook.capture(plan, input_ids, hidden, aux_arg)

    def dumps(self) -> dict[str, Dump]:
        self.hook.flush()
        out: dict[str, Dump] = {}
        for path in scan(self.dump_dir).complete:
            rid = path.joinpath("meta.json").read_text().split('"rid": "')[1].split('"')[0]
            s = self.states[rid]
            exp = Expected(
                rid=rid,
                input_fingerprint=fingerprint(s.ids),
                num_tokens=len(s.ids),
                layer_ids=LAYERS,
                hidden_size=H,
                dtype="bfloat16",
                model_id=IDENT.model_id,
            )
            dump = read_dump(path, exp)
            assert torch.equal(dump.aux_hidden_states, s.aux)
            assert torch.equal(dump.last_hidden_state, s.last)
            out[rid] = dump
        return out


def make_server(tmp_path: Path, *, rank: int = 0, clock: Clock | None = None, **cfg: Any) -> Server:
    dump_dir = tmp_path / "dumps"
    config = HookConfig(dump_dir=dump_dir, **cfg)
    hook = DumpHook(
        config, DumpContext(IDENT, LAYERS), attn_tp_rank=rank, clock=clock or time.monotonic
    )
    return Server(hook, dump_dir)


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
def test_cuda_copies_are_pinned_async_and_exact(server: Server) -> None:
    """The GPU path: side-stream copies into pinned memory, then the states are
    overwritten in place on the compute stream (as a reused CUDA-graph buffer would be);
    the dump must still hold the values at capture time."""
    a, b = server.add("hsq-a", 300), server.add("hsq-b", 1000)
    plan = server.hook.plan([a, b], [0, 0], [300, 1000])
    assert plan is not None
    s_a, s_b = server.states["hsq-a"], server.states["hsq-b"]
    ids = torch.tensor(s_a.ids + s_b.ids, device="cuda")
    hidden = torch.cat([s_a.last, s_b.last]).cuda()
    aux = [torch.cat([s_a.aux, s_b.aux])[:, j * H : (j + 1) * H].cuda() for j in range(3)]
    torch.cuda.synchronize()
    assert server.hook.capture(plan, ids, hidden, aux)
    hidden.fill_(float("nan"))
    for t in aux:
        t.fill_(float("nan"))
    assert sorted(server.dumps()) == ["hsq-a", "hsq-b"]
    host, ready = HostCopier().copy([hidden])
    assert host[0].is_pinned() and ready is not None


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
    from sglang_server.sglang_hook.accumulator import Chunk

    s = srv.states["hsq-a"]
    chunk = Chunk(plan.entries[0], torch.tensor(s.ids), s.last, [s.aux])
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

    def logits_forward(proc: object, *args: Any, **kwargs: Any) -> str:
        calls.append("logits")
        return "logits-output"

    def run_batch(sched: object, batch: object) -> str:
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
        assert plugin.around_run_batch(lambda s, b: "decoded", None, decode) == "decoded"
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
    assert "sglang_server.sglang_hook.launch" in old and "--disable-overlap-schedule" in old
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
        [sys.executable, "-m", "sglang_server.sglang_hook.launch", "--model-path", "m"],
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
    """The mechanism launch.py relies on: spawn re-runs `python -m pkg.mod`'s top level
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
    """Issue 12: K requests in flight land in one prefill batch; each gets its own dump."""
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

    def logits_forward(proc: object, *args: Any, **kwargs: Any) -> str:
        seen.append(args)
        return "logits"

    def run_batch(sched: object, b: object) -> object:
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
