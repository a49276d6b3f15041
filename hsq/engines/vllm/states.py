"""From the rows vLLM hands the connector to the tensors of one hsq dump (pure torch)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hsq.engines.vllm.checkpoint import FinalNorm
from hsq.engines.vllm.layers import aux_rows
from hsq.quant import quantize_on_device
from hsq.states import AUX_TENSOR, FP8, LAST_TENSOR, PRENORM_TENSOR, scale_name


def shape_problem(hidden: torch.Tensor, token_ids: torch.Tensor, captured: Sequence[int]) -> str:
    """Why these tensors are not one request's ``[T, k, H]`` rows ("" if they are)."""
    if token_ids.dim() != 1:
        return f"token_ids {tuple(token_ids.shape)} is not [T]"
    if hidden.dim() != 3 or hidden.shape[0] != token_ids.shape[0]:
        return f"hidden_states {tuple(hidden.shape)} is not [T={token_ids.shape[0]}, k, H]"
    if hidden.shape[1] != len(captured):
        return f"hidden_states has {hidden.shape[1]} layers, {len(captured)} were captured"
    if hidden.shape[0] == 0:
        return "no tokens"
    return ""


def dump_tensors(
    hidden: torch.Tensor,
    captured: Sequence[int],
    layer_ids: Sequence[int],
    norm: FinalNorm,
    *,
    prenorm: bool = False,
    encoding: str = "plain",
) -> dict[str, torch.Tensor]:
    """The dump's tensors in file order: aux ``[T, k*H]`` in the run's layer order, the
    post-norm final state (the norm applied to vLLM's id ``L``, the last captured row), and
    with ``prenorm`` that row itself; with fp8-e4m3 each quantized with its scales."""
    t, _, h = hidden.shape
    rows = aux_rows(layer_ids, captured)
    aux = hidden[:, rows, :].reshape(t, len(rows) * h)
    final = hidden[:, len(captured) - 1, :]  # captured is sorted: L is last
    states = {AUX_TENSOR: aux.contiguous(), LAST_TENSOR: norm.apply(final).contiguous()}
    if prenorm:
        states[PRENORM_TENSOR] = final.contiguous()
    if encoding != FP8:
        return states
    out: dict[str, torch.Tensor] = {}
    for name, x in states.items():
        q, scale = quantize_on_device(x, x.shape[1] // h)
        out[name], out[scale_name(name)] = q, scale
    return out
