"""The truth the served states are held to: a float32 transformers forward of the same
checkpoint (its bf16 weights upcast), with every residual-stream state kept.

MoE routing replay. A random MoE's top-k choice flips under the bf16 differences between
SGLang's kernels and this float32 forward (seen live: worst cosine 0.931, 95 of 120 samples
outside the tolerance, all 8 experts per token: 0.999999). So for an MoE layer the
reference can take the experts the server chose for each token (SGLang's
--enable-return-routed-experts: `meta_info.routed_experts`, int32 [T, layers, top-k]) and
compute everything else itself: router scores in float32, the chosen experts' weights
from its own scores, the experts and the shared expert. The replayed forward then differs
from the server's only by arithmetic noise, as a dense model does, and a wrong layer, a
wrong sample or a stale row stands out as in the dense case.

The MoE block is computed here from the module's parameters (router weight and bias, the
fused expert tensors, the shared expert), not through transformers' MoE forward, so the
replay does not depend on how a transformers release spells its router's outputs;
tests/test_live_reference.py checks that without a replay it equals transformers' own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np

LAST = "last"
PRENORM = "prenorm"


class Reference:
    """States by HF hidden_states index (i: the stream entering decoder layer i, for
    i < L), plus LAST (the final norm's output) and PRENORM (its input), float32 on CPU."""

    def __init__(
        self, model_dir: Path, device: str, keep: Collection[int | str] | None = None
    ) -> None:
        # keep: only these states are kept (a long sample's other layers would take GPU
        # memory the forward needs: 1 GiB each at 64K tokens of hidden 4096).
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]
        self.device = device
        self.captured: dict[int | str, Any] = {}
        self.keep = None if keep is None else set(keep)
        self.routing: Any = None
        """None, or the server's expert ids [T, layers, k] for the next forward."""
        self.moe_layers: list[int] = []
        inner = self.model.model
        self.num_layers = len(inner.layers)
        for i, layer in enumerate(inner.layers):
            layer.register_forward_pre_hook(self._pre(i), with_kwargs=True)
            mlp = getattr(layer, "mlp", None)
            if mlp is not None and hasattr(mlp, "gate") and hasattr(mlp, "experts"):
                self.moe_layers.append(i)
                mlp.forward = self._moe_forward(mlp, i)
        inner.norm.register_forward_hook(lambda _m, _a, out: self._keep(LAST, out))
        inner.norm.register_forward_pre_hook(lambda _m, args: self._keep(PRENORM, args[0]))

    def _keep(self, key: int | str, state: Any) -> None:
        if self.keep is None or key in self.keep:
            self.captured[key] = state

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._keep(i, args[0] if args else kwargs["hidden_states"])

        return hook

    def _moe_forward(self, mlp: Any, layer: int) -> Callable[[Any], Any]:
        def forward(hidden_states: Any) -> Any:
            chosen = None if self.routing is None else self.routing[:, layer, :]
            return moe_block(self.torch, mlp, hidden_states, chosen)

        return forward

    def states(
        self, input_ids: list[int], routing: np.ndarray | None = None
    ) -> dict[int | str, Any]:
        """Every state of one forward of `input_ids`; `routing`: the server's expert ids
        [T, layers, k] (rows of dense layers unused)."""
        torch = self.torch
        if routing is not None and routing.shape[0] != len(input_ids):
            raise ValueError(f"routing has {routing.shape[0]} rows for {len(input_ids)} tokens")
        with torch.inference_mode():
            self.captured.clear()
            # A copy: the routing comes from a read-only memory map, and torch warns (an error
            # under the suite's filterwarnings) when asked to wrap a non-writable array.
            self.routing = (
                None
                if routing is None
                else torch.as_tensor(routing.copy(), device=self.device).long()
            )
            try:
                self.model.model(torch.tensor([input_ids], device=self.device))
            finally:
                self.routing = None
            return {k: v[0].float().cpu() for k, v in self.captured.items()}


def moe_block(torch: Any, mlp: Any, hidden_states: Any, chosen: Any | None) -> Any:
    """DeepSeek-V3's MoE block (sigmoid router, noaux_tc top-k, normalized weights times
    the routed scaling factor, plus the shared expert) in the input's dtype; `chosen` [N, k]
    replaces the top-k choice (the weights still come from this forward's scores)."""
    gate, experts = mlp.gate, mlp.experts
    shape = hidden_states.shape
    h = hidden_states.reshape(-1, shape[-1])
    scores = torch.nn.functional.linear(h.float(), gate.weight.float()).sigmoid()
    if chosen is None:
        biased = scores + gate.e_score_correction_bias.float()
        chosen = _grouped_topk(torch, biased, gate)
    weights = scores.gather(1, chosen)
    if getattr(gate, "norm_topk_prob", True):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * gate.routed_scaling_factor
    out = torch.zeros_like(h, dtype=torch.float32)
    act = experts.act_fn
    for e in torch.unique(chosen).tolist():
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        x = h[rows]
        gate_up = torch.nn.functional.linear(x, experts.gate_up_proj[e])
        g, u = gate_up.chunk(2, dim=-1)
        y = torch.nn.functional.linear(act(g) * u, experts.down_proj[e])
        out.index_add_(0, rows, (y.float() * weights[rows, slot, None]))
    out = out.to(h.dtype).reshape(shape)
    return out + mlp.shared_experts(hidden_states)


def _grouped_topk(torch: Any, biased: Any, gate: Any) -> Any:
    n_group = int(getattr(gate, "num_group", getattr(gate, "n_group", 1)) or 1)
    topk_group, k = gate.topk_group, gate.top_k
    if n_group <= 1:
        return torch.topk(biased, k=k, dim=-1, sorted=False)[1]
    e = biased.shape[-1]
    grouped = biased.view(-1, n_group, e // n_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
    mask = mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    return torch.topk(biased.masked_fill(mask == 0, float("-inf")), k=k, dim=-1, sorted=False)[1]
