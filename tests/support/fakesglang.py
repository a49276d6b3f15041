"""The SGLang side of the hook's tests, without SGLang: a DumpHook fed by a synthetic model
(Server: plans and forwards of chosen requests, dumps read back and compared with the states
that went in), a ModelRunner as the load-model hook sees it (FakeRunner), and the plugin
switched on in a test's environment (use_plugin)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hsq import quant
from hsq.dump.find import scan
from hsq.dump.format import fingerprint
from hsq.dump.read import Dump, Expected, read_dump
from hsq.dump.ready import READY_FILE
from hsq.engines.common import DumpContext, model_identity
from hsq.engines.sglang import plugin
from hsq.engines.sglang.config import HookConfig
from hsq.engines.sglang.dump_hook import DumpHook
from hsq.states import AUX_TENSOR, LAST_TENSOR, PRENORM_TENSOR

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
    pre: torch.Tensor  # [T, H], the final norm's input


def states_for(n: int, seed: int) -> States:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32000, (n,), generator=g).tolist()
    aux = torch.randn(n, len(LAYERS) * H, generator=g).to(torch.bfloat16)
    last = torch.randn(n, H, generator=g).to(torch.bfloat16)
    pre = (torch.randn(n, H, generator=g) * 20).to(torch.bfloat16)
    return States(ids, aux, last, pre)


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
        ids, aux, last, pre = [], [], [], []
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
            pre.append(torch.cat([s.pre[p : p + e], torch.ones(tail, H, dtype=torch.bfloat16)]))
        input_ids = torch.cat([*ids, torch.zeros(pad, dtype=torch.int64)])
        hidden = torch.cat([*last, torch.zeros(pad, H, dtype=torch.bfloat16)])
        prenorm = torch.cat([*pre, torch.zeros(pad, H, dtype=torch.bfloat16)])
        packed_aux = torch.cat([*aux, torch.zeros(pad, len(LAYERS) * H, dtype=torch.bfloat16)])
        # Llama passes a list of k [T, H] tensors (cloned by SGLang), DeepSeek one packed.
        per_layer = [packed_aux[:, j * H : (j + 1) * H].clone() for j in range(len(LAYERS))]
        aux_arg: Any = packed_aux if packed else per_layer
        if self.hook.cfg.prenorm:
            return self.hook.capture(plan, input_ids, hidden, aux_arg, prenorm)
        return self.hook.capture(plan, input_ids, hidden, aux_arg)

    def dumps(self) -> dict[str, Dump]:
        """Every dump, read back as the worker reads it, each compared with the states
        its request computed (fp8: with hsq.quant.quantize of them, bit for bit)."""
        self.hook.flush()
        cfg = self.hook.cfg
        out: dict[str, Dump] = {}
        for path in scan(self.dump_dir).complete:
            rid = path.joinpath("meta.json").read_text().split('"rid": "')[1].split('"')[0]
            s = self.states[rid]
            exp = Expected(
                rid=rid,
                input_fingerprint=fingerprint(s.ids),
                num_tokens=len(s.ids),
                layer_ids=list(self.hook.ctx.layer_ids),
                hidden_size=H,
                dtype="bfloat16",
                model_id=self.hook.ctx.model.model_id,
                store_dtype="fp8-e4m3" if cfg.encoding == "fp8-e4m3" else "bf16",
                prenorm=cfg.prenorm,
            )
            dump = read_dump(path, exp)
            assert dump.meta.encoding == cfg.encoding and dump.meta.prenorm == cfg.prenorm
            want = {AUX_TENSOR: (s.aux, 3), LAST_TENSOR: (s.last, 1)}
            if cfg.prenorm:
                want[PRENORM_TENSOR] = (s.pre, 1)
            for name, (x, groups) in want.items():
                got = dump.tensors[name]
                if cfg.encoding == "fp8-e4m3":
                    q, scale = quant.quantize(x, groups)
                    assert torch.equal(got.view(torch.uint8), q.view(torch.uint8)), name
                    assert torch.equal(dump.tensors[name + "_scale"], scale), name
                else:
                    assert torch.equal(got, x), name
            out[rid] = dump
        return out


def make_server(tmp_path: Path, *, rank: int = 0, clock: Clock | None = None, **cfg: Any) -> Server:
    dump_dir = tmp_path / "dumps"
    config = HookConfig(dump_dir=dump_dir, **cfg)
    hook = DumpHook(
        config, DumpContext(IDENT, LAYERS), attn_tp_rank=rank, clock=clock or time.monotonic
    )
    return Server(hook, dump_dir)


GOOD_ARGS: dict[str, Any] = {
    "disable_radix_cache": True,
    "dp_size": 1,
    "attn_dp_size": 1,
    "enable_dp_attention": False,
    "pp_size": 1,
    "tp_size": 8,
    "attn_cp_size": 1,
    "enable_prefill_cp": False,
    "enable_two_batch_overlap": False,
    "moe_a2a_backend": "none",
    "moe_dense_tp_size": None,
    "enable_layernorm_sp": False,
    "cuda_graph_backend_prefill": None,
    "disable_prefill_cuda_graph": True,
    "speculative_algorithm": None,
    "enable_return_hidden_states": False,
}


@dataclass
class FakeRunner:
    """A ModelRunner as the load-model hook sees it; ``model`` follows SGLang's DeepSeek
    (or Llama) layer rule when the hook calls set_eagle3_layers_to_capture."""

    model: Any
    model_config: Any
    server_args: Any
    is_draft_worker: bool = False
    loads: int = 0
    marker_at_load: bool | None = None
    dump_dir: Path | None = None

    @classmethod
    def kimi(
        cls,
        tmp_path: Path,
        *,
        server_args: Any = None,
        rule: Callable[..., list[int]] | None = None,
    ) -> FakeRunner:
        inner = SimpleNamespace(layers_to_capture=[])

        def set_ids(ids: list[int] | None) -> None:
            # DeepseekV2ForCausalLM.set_eagle3_layers_to_capture, sglang >= 0.5.13
            if rule is not None:
                inner.layers_to_capture = rule(ids)
            elif ids is None:
                inner.layers_to_capture = [2, 61 // 2, 61 - 3]
            else:
                inner.layers_to_capture = [i + 1 for i in ids] if ids[0] == 1 else list(ids)

        lm = SimpleNamespace(model=inner, set_eagle3_layers_to_capture=set_ids)
        hf = SimpleNamespace(
            architectures=["KimiK25ForConditionalGeneration"], to_dict=lambda: {"kimi": 1}
        )
        mc = SimpleNamespace(
            model_path="/models/Kimi-K2.5/",
            hf_config=hf,
            hf_text_config=SimpleNamespace(num_hidden_layers=61, hidden_size=H),
        )
        args = server_args or SimpleNamespace(**GOOD_ARGS)
        return cls(SimpleNamespace(language_model=lm), mc, args, dump_dir=tmp_path / "dumps")

    def load(self, runner: FakeRunner) -> str:
        assert runner is self
        self.loads += 1
        assert self.dump_dir is not None
        self.marker_at_load = (self.dump_dir / READY_FILE).exists()
        return "loaded"


def use_plugin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, rank: int = 0, layer_ids: str | None = None
) -> Path:
    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(dump_dir))
    if layer_ids is not None:
        monkeypatch.setenv("SGLANG_HS_LAYER_IDS", layer_ids)
    monkeypatch.setattr(plugin, "_sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(plugin, "_attn_tp_rank", lambda: rank)
    monkeypatch.setattr(plugin, "_hook", None)
    return dump_dir
