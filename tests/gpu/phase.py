"""One live phase: serve a model through `hsq launch-sglang`, extract a mixed-length
dataset with hsq's worker (K in flight, chunked prefill, optionally a SIGKILL and restart),
then hold every stored state to the reference forward (tests/gpu/equality.py) and show
that the check fails on planted faults. For MoE models the worker talks through the
routing proxy, so the reference replays the experts of the very forward that was dumped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsq.closeness.rule import FP8_MAX_ABS_OF_NORM, MAX_ABS_OF_NORM, MIN_COSINE
from hsq.engines.sglang import compat
from hsq.engines.sglang.layers import effective_layer_ids
from tests.gpu import equality as eq
from tests.gpu.extract import Extraction, lengths_mixed, make_dataset
from tests.gpu.proxy import RoutingProxy
from tests.gpu.reference import LAST, PRENORM, Reference
from tests.gpu.results import Results
from tests.gpu.settings import LiveSettings
from tests.support.sglang import SGLANG_FLAGS, SGLangServer

VOCAB = 32000


@dataclass(frozen=True)
class Model:
    name: str
    served: Path
    """The checkpoint SGLang serves."""
    reference: Path
    """The checkpoint the reference forward loads (Kimi: its DeepSeek-V3 text backbone)."""
    family: str
    num_layers: int
    layers: str
    """--layers as a drafter config names them (SGLang's per-model rule maps them)."""
    moe_top_k: int = 0
    env: dict[str, str] = field(default_factory=dict)
    dense_layers: int = 0
    """Leading decoder layers without experts (DeepSeek's first_k_dense_replace): the
    states entering layers 1..dense_layers see no routing."""

    @property
    def moe(self) -> bool:
        return self.moe_top_k > 0


@dataclass
class Phase:
    model: Model
    live: LiveSettings
    results: Results
    section: str
    work: Path
    dump_dir: Path
    redis_url: str
    samples: int
    fp8_prenorm: bool = False
    kill: bool = True
    audit: bool = False
    server_factory: Callable[..., Any] = SGLangServer
    """What serves (SGLangServer; tests/test_live_phase_cpu.py: hsq's reference server)."""
    sglang_version: str | None = None
    """The layer-id rule's version (None: the installed SGLang's)."""
    figures: dict[str, Any] = field(default_factory=dict)
    _proxy: RoutingProxy | None = None
    _out: Path = Path()
    _layer_ids: list[int] = field(default_factory=list)
    _alone: dict[str, Any] | None = None

    def record(self, **kw: Any) -> None:
        self.figures.update(kw)
        self.results.record(self.section, **kw)

    def run(self) -> dict[str, Any]:
        m, live = self.model, self.live
        # A fixed KV pool: --mem-fraction-static counts what the other servers on the GPU
        # already hold, so a server started while another allocated got 836 tokens and
        # refused every sample longer than that (400 "Input length exceeds", live run 3).
        flags = [
            *SGLANG_FLAGS, "--mem-fraction-static", "0.12", "--max-total-tokens", "131072",
            "--chunked-prefill-size", str(live.chunk), "--max-running-requests", "64",
        ]  # fmt: skip
        if m.moe:
            flags.append("--enable-return-routed-experts")
        if self.fp8_prenorm:
            flags += ["--dump-encoding", "fp8-e4m3", "--prenorm"]
        server = self.server_factory(
            m.served, self.work / "server.log", dump_dir=self.dump_dir, layers=m.layers,
            flags=flags, tp=live.tp, env=m.env, start_timeout=live.start_timeout,
        )  # fmt: skip
        version = self.sglang_version
        if version is None:
            import sglang  # type: ignore[import-not-found,unused-ignore]

            version = str(sglang.__version__)
        given = [int(x) for x in m.layers.split(",")]
        want_ids = effective_layer_ids(
            m.family,  # type: ignore[arg-type]
            m.num_layers,
            given,
            deepseek_first_id_rule=compat.deepseek_first_id_rule(version),
        )
        self.record(model=m.name, layers_given=given, layers_expected=want_ids, tp=live.tp,
                    chunked_prefill_size=live.chunk, fp8_prenorm=self.fp8_prenorm)  # fmt: skip
        lengths = lengths_mixed(self.samples, 1, chunk=live.chunk, equal_pairs=4 if m.moe else 0)
        data = make_dataset(self.work / "data.jsonl", lengths, vocab=VOCAB, seed=2)
        self.record(longest=max(lengths), longer_than_chunk=sum(n > live.chunk for n in lengths))
        try:
            self.record(start_s=round(server.start(), 1))
            self._serve(server, data)
        except Exception as exc:  # what the run saw goes to the results before it fails
            tail = [ln[-300:] for ln in server.log_text().splitlines()[-40:]]
            self.record(error=f"{type(exc).__name__}: {exc}"[-3000:], server_log_tail=tail)
            raise
        finally:
            server.stop()
        self.record(equality=self.equality(data, self._out, self._layer_ids, self._proxy))
        if self._alone is not None:
            self.record(audit=self._alone)
        return self.figures

    def _serve(self, server: Any, data: dict[str, list[int]]) -> None:
        m, live = self.model, self.live
        marker = json.loads((self.dump_dir / "hsq-ready.json").read_text())
        keys = ("server", "server_version", "layer_ids", "encoding", "prenorm")
        self.record(ready_marker={k: marker.get(k) for k in keys})
        lines = server.log_text().splitlines()
        self.record(hook_log=[ln[-300:] for ln in lines if "hs_dump:" in ln][:3])
        layer_ids = [int(i) for i in marker["layer_ids"]]
        run_flags = ["--store-dtype", "fp8-e4m3", "--prenorm"] if self.fp8_prenorm else []
        replay = m.moe and live.routing == "proxy"
        proxy = (
            RoutingProxy(server.url, num_layers=m.num_layers, top_k=m.moe_top_k) if replay else None
        )
        with proxy or _Nothing():
            ext = Extraction(
                self.work, self.section.replace("/", "-"), data, self.work / "data.jsonl",
                self.redis_url, server, proxy.url if proxy else server.url,
                ",".join(map(str, layer_ids)), live.inflight, run_flags,
            )  # fmt: skip
            kill_at = 1 / 3 if (self.kill and live.kill) else None
            try:
                ext.go(kill_at=kill_at)
            finally:
                self.record(run=ext.res)
                if proxy is not None:
                    self.record(routing_errors=proxy.errors[:10], routed=len(proxy.by_rid))
            self._proxy, self._out, self._layer_ids = proxy, ext.out_dir, layer_ids
            if self.audit and m.moe:
                from tests.gpu.audit_live import batched_vs_alone

                self._alone = batched_vs_alone(self, server, proxy, data, ext.out_dir)
        lines = server.log_text().splitlines()
        errors = [ln[-200:] for ln in lines if "hs_dump" in ln and (
            "error" in ln.lower() or "fail" in ln.lower())]  # fmt: skip
        self.record(server_log_errors=errors[:10])

    def equality(
        self, data: dict[str, list[int]], out_dir: Path, layer_ids: list[int], proxy: Any
    ) -> dict[str, Any]:
        import torch

        from hsq import quant
        from hsq.outputs import open_output
        from hsq.states import FP8

        ref = Reference(self.model.reference, "cuda" if torch.cuda.is_available() else "cpu")
        self.results.say(f"{self.section}: comparing with the reference forward")
        kinds = ["correct", "off_by_one", "swapped", "stale_row", "stale_shift"]
        if self.model.moe:
            kinds.insert(1, "free_routing")
        dist = {k: eq.Distribution(k) for k in kinds}
        ids_wrong: list[str] = []
        several = 0
        worst_cos, worst_err, outside = 1.0, 0.0, []
        prev: tuple[dict[str, Any], dict[str, Any]] | None = None
        shifted_ids = eq.shifted(layer_ids, ref.num_layers)
        files = sorted(out_dir.rglob("*.safetensors"))
        # MoE without the server's expert choices: the dense prefix strictly, the rest
        # under hsq's MoE allowance (equality.compare_moe).
        no_replay = self.model.moe and proxy is None
        dense_aux = sum(1 for i in layer_ids if i <= self.model.dense_layers)

        def judge(got: dict[str, Any], want: dict[str, Any], fp8: bool) -> eq.Comparison:
            if not no_replay:
                return eq.compare(got, want, fp8=fp8)
            return eq.compare_moe(got, want, aux_layers=len(layer_ids), dense_aux=dense_aux,
                                  fp8=fp8)  # fmt: skip

        fmt, with_prenorm = "", False
        for f in files:
            o = open_output(f)
            ids = data[o.sample_id]
            if o.input_ids.tolist() != ids:
                ids_wrong.append(o.sample_id)
                continue
            fmt = quant.store_dtype_of(o.metadata)
            fp8 = fmt == FP8
            prenorm = getattr(o, "last_hidden_state_prenorm", None) is not None
            with_prenorm = with_prenorm or prenorm
            stored = eq.stored_tensors(o)
            routings = [r.experts for r in proxy.for_input(ids)] if proxy is not None else [None]
            several += len(routings) > 1
            best = None
            for routing in routings or [None]:  # the dump came from one of these attempts
                states = ref.states(ids, routing)
                want = eq.expected_tensors(states, layer_ids, prenorm=prenorm, fp8=fp8,
                                           last_key=LAST, prenorm_key=PRENORM)  # fmt: skip
                c = judge(stored, want, fp8)
                if best is None or c.bad_rows < best[0].bad_rows:
                    best = (c, states, want)
            assert best is not None
            c, states, want = best
            dist["correct"].add(c)
            worst_cos, worst_err = min(worst_cos, c.min_cosine), max(worst_err, c.max_abs_over_norm)
            if not c.ok:
                outside.append((o.sample_id, c.bad_rows, round(c.min_cosine, 5)))
            if self.model.moe:
                own = states if no_replay else ref.states(ids)
                free = eq.expected_tensors(own, layer_ids, prenorm=prenorm,
                                           fp8=fp8, last_key=LAST, prenorm_key=PRENORM)  # fmt: skip
                dist["free_routing"].add(eq.compare(stored, free, fp8=fp8))
            off = eq.expected_tensors(states, shifted_ids, prenorm=False, fp8=fp8, last_key=LAST)
            dist["off_by_one"].add(judge({eq.AUX: stored[eq.AUX]}, {eq.AUX: off[eq.AUX]}, fp8))
            mid = len(ids) // 2
            if prev is not None:
                p_stored, _ = prev
                dist["swapped"].add(judge(p_stored, want, fp8), rows=None)
                if p_stored[eq.LAST_NAME].shape[0] > mid:
                    planted = eq.with_row(stored, p_stored, mid, mid)
                    dist["stale_row"].add(judge(planted, want, fp8), rows=[mid])
            if mid >= 1:
                planted = eq.with_row(stored, stored, mid, mid - 1)
                dist["stale_shift"].add(judge(planted, want, fp8), rows=[mid])
            prev = (stored, want)
        return {
            "files": len(files),
            "store_dtype": fmt,
            "prenorm_compared": with_prenorm,
            "ids_exact": not ids_wrong,
            "ids_wrong": ids_wrong[:10],
            "layer_ids": layer_ids,
            "off_by_one_ids": shifted_ids,
            "routing_replayed": self.model.moe and not no_replay,
            "rule": (
                f"aux ids <= {self.model.dense_layers} ({dense_aux} of {len(layer_ids)}) row by "
                "row; the rest under the MoE allowance"
                if no_replay
                else "every row within the tolerance"
            ),
            "samples_with_several_routings": several,
            "min_cosine": round(worst_cos, 6),
            "max_abs_over_norm": round(worst_err, 6),
            "tolerance": f"cosine >= {MIN_COSINE}, max|d| <= "
            f"{FP8_MAX_ABS_OF_NORM if fmt == 'fp8-e4m3' else MAX_ABS_OF_NORM} * ||row||",
            "samples_outside_tolerance": len(outside),
            "outside_examples": outside[:10],
            "distributions": {k: d.summary() for k, d in dist.items()},
        }


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def assert_phase(fig: dict[str, Any], *, samples: int, moe: bool) -> None:
    """What a correct server must show (checked after every figure is recorded)."""
    run, e = fig["run"], fig["equality"]
    assert fig["ready_marker"]["layer_ids"] == fig["layers_expected"], fig["ready_marker"]
    assert run["status"]["done"] == samples and run["status"]["dead"] == 0, run
    assert run["marked_done_once"] and run["verify_deep_exit"] == 0, run
    assert e["files"] == samples and e["ids_exact"], e
    assert e["samples_outside_tolerance"] == 0, e
    d = e["distributions"]
    for kind in ("off_by_one", "swapped", "stale_row", "stale_shift"):
        assert d[kind]["samples"] > 0 and d[kind]["samples_failed"] == d[kind]["samples"], d[kind]
    if moe:
        assert not fig.get("routing_errors"), fig.get("routing_errors")
