"""The dump a server that is not a model writes for one request: the null-model server's
(tests/support/nullserver.py) and the tests' (tests/hostile.py). The meta of a prefill of
``ids`` under ``rid``, and random normal states of the right shapes: finite, as a real
model's, so everything a worker checks holds. And `make`: one such dump written into a
dump dir, its meta open to any change (the protocol's and the worker's unit tests)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hsq.dump.format import DTYPES, DumpMeta, ModelIdentity, expected_shapes, fingerprint
from hsq.dump.write import write_dump
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


IDENT = ModelIdentity("unit", "LlamaModel", 8, 16, "0" * 64)
LAYERS = [2, 4, 5]
IDS = list(range(100, 112))


def make(
    dump_dir: Path, index: int, ids: list[int], rid: str, *, mark_done: bool = True, **over: object
) -> Path:
    """A bf16 dump of a prefill of `ids` under `rid` as req_<index> (states seeded by the
    index); `over` replaces fields of its meta."""
    import torch

    n = len(ids)
    gen = torch.Generator().manual_seed(index)
    tensors = {
        AUX_TENSOR: torch.randn(n, len(LAYERS) * 16, generator=gen).to(torch.bfloat16),
        LAST_TENSOR: torch.randn(n, 16, generator=gen).to(torch.bfloat16),
    }
    fields: dict[str, object] = dict(
        rid=rid,
        num_tokens=n,
        input_fingerprint=fingerprint(ids),
        layer_ids=LAYERS,
        hidden_size=16,
        dtype="bfloat16",
        model=IDENT,
        tensors=expected_shapes(n, len(LAYERS), 16),
        request_index=index,
    )
    fields.update(over)
    meta = DumpMeta(**fields)  # type: ignore[arg-type]
    return write_dump(dump_dir, index, meta, tensors, mark_done=mark_done)
