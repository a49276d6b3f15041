"""The dump a server that is not a model writes for one request: the null-model server's
(tests/support/nullserver.py) and the tests' (tests/hostile.py). The meta of a prefill of
``ids`` under ``rid``, and random normal states of the right shapes: finite, as a real
model's, so everything a worker checks holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsq.dump.format import DTYPES, DumpMeta, ModelIdentity, expected_shapes, fingerprint
from hsq.states import AUX_TENSOR, LAST_TENSOR

if TYPE_CHECKING:
    import torch


def request_meta(
    ids: list[int],
    rid: str,
    *,
    model: ModelIdentity,
    layer_ids: list[int],
    hidden_size: int,
    dtype: str,
    index: int = 0,
) -> DumpMeta:
    n = len(ids)
    return DumpMeta(
        rid=rid,
        num_tokens=n,
        input_fingerprint=fingerprint(ids),
        layer_ids=layer_ids,
        hidden_size=hidden_size,
        dtype=dtype,
        model=model,
        tensors=expected_shapes(n, len(layer_ids), hidden_size),
        request_index=index,
    )


def random_states(
    rows: int, layers: int, hidden_size: int, dtype: str, seed: int
) -> dict[str, torch.Tensor]:
    """The aux states [rows, layers * H] and the last state [rows, H], seeded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        AUX_TENSOR: torch.randn(rows, layers * hidden_size, generator=g).to(DTYPES[dtype]),
        LAST_TENSOR: torch.randn(rows, hidden_size, generator=g).to(DTYPES[dtype]),
    }
