"""One sample's output as the worker writes it, from a dump written as a server writes one:
bf16 states with zero rows in them (a whole zero token, one zero layer row), the edges fp8
quantization must keep exact."""

from __future__ import annotations

from pathlib import Path

import torch

from hsq.dataset.jsonl import Sample
from hsq.dump.format import DumpMeta, expected_shapes, fingerprint
from hsq.dump.read import open_dump_tensors
from hsq.dump.write import write_dump
from hsq.outputs.manifest import ManifestEntry
from hsq.outputs.transcode import write_output
from hsq.states import AUX_TENSOR, LAST_TENSOR
from hsq.stfile.engine import WriteEngine
from tests.support.fakedump import IDENT, LAYERS

H = 16


def states(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    aux = (torch.randn(n, len(LAYERS) * H, generator=gen) * 3).to(torch.bfloat16)
    last = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    aux[1] = 0  # a whole zero token
    aux[2, H : 2 * H] = 0  # one zero layer row
    last[3] = 0
    return {AUX_TENSOR: aux, LAST_TENSOR: last}


def written(
    tmp: Path, store_dtype: str, n: int = 9
) -> tuple[Path, ManifestEntry, dict[str, torch.Tensor]]:
    """A dump written as the server does, persisted as the worker does."""
    dumps = tmp / "dumps"
    dumps.mkdir(exist_ok=True)
    ids = list(range(100, 100 + n))
    tensors = states(n)
    meta = DumpMeta(
        "r", n, fingerprint(ids), LAYERS, H, "bfloat16", IDENT, expected_shapes(n, 3, H), 0
    )
    dump_path = write_dump(dumps, len(list(dumps.iterdir())), meta, tensors)
    dump = open_dump_tensors(dump_path, meta)
    path = tmp / store_dtype / "s1.safetensors"
    try:
        with WriteEngine() as engine:
            sample = Sample("s1", ids, None)
            nbytes, crc = write_output(path, sample, meta, dump, "run", store_dtype, engine=engine)
    finally:
        dump.close()
    entry = ManifestEntry(path.name, n, nbytes, crc, "w", 0.0, 1, store_dtype)
    return path, entry, tensors
