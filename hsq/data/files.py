"""Train in place: a PyTorch Dataset over a finished run's output directory.

    from torch.utils.data import DataLoader
    from hsq.data import HiddenStateDataset, collate

    ds = HiddenStateDataset("/shared/hs/kimi-v1", max_length=2048)
    loader = DataLoader(ds, batch_size=8, num_workers=4, collate_fn=collate, shuffle=True)

Each item maps its safetensors file (hsq.outputs.open_output) instead of copying it, so
a multi-TB run needs no second copy to train from, and nothing is unpickled. The sample
list comes from `manifest.jsonl` in the directory (`hsq export --format manifest` writes
it from the run's manifest in Redis); without one, every `*.safetensors` file under the
directory is used, in sorted order, and `lengths` reads each file's header (once, on first
use). The dataset holds only paths, so it pickles cheaply into DataLoader worker processes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from hsq import jsonsafe
from hsq.errors import OutputError
from hsq.outputs.format import (
    IDS_TENSOR,
    REQUIRED_TENSORS,
    SUFFIX,
    OutputSample,
    open_output,
    read_header,
)
from hsq.states import PRENORM_TENSOR

log = structlog.get_logger("hsq.data")

MANIFEST = "manifest.jsonl"
KEYS = REQUIRED_TENSORS
PRENORM = PRENORM_TENSOR
"""In items (and batches) of runs enqueued with --prenorm only."""


@dataclass(frozen=True)
class Item:
    sample_id: str
    relpath: str
    num_tokens: int


def read_manifest(root: Path) -> list[Item]:
    """Entries of `root/manifest.jsonl`; each path must stay under root."""
    items = []
    base = root.resolve()
    with open(root / MANIFEST) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = jsonsafe.loads(line)
                item = Item(str(obj["id"]), str(obj["path"]), int(obj["num_tokens"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise OutputError(f"{root / MANIFEST} line {n}: bad entry: {exc}") from exc
            if not (base / item.relpath).resolve().is_relative_to(base):
                raise OutputError(f"{root / MANIFEST} line {n}: path escapes {root}")
            items.append(item)
    return items


def scan_outputs(root: Path) -> list[Item]:
    items = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(SUFFIX) and not name.startswith("."):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                items.append(Item(name.removesuffix(SUFFIX), rel, -1))
    return sorted(items, key=lambda i: i.relpath)


def header_tokens(root: Path, item: Item) -> int:
    """The token count of one output file from its safetensors header (no tensor read)."""
    path = root / item.relpath
    try:
        info = read_header(path).tensors.get(IDS_TENSOR)
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: not a readable output file: {exc}") from exc
    if info is None or len(info.shape) != 1:
        raise OutputError(f"{path}: no one-dimensional {IDS_TENSOR} tensor")
    return info.shape[0]


class HiddenStateDataset:
    """`ds[i]` -> {"id", "input_ids" [T], "loss_mask" [T], "aux_hidden_states" [T, k*H],
    "last_hidden_state" [T, H]}, plus "last_hidden_state_prenorm" [T, H] for runs that store
    it, T cut to `max_length` if given (views, no copies)."""

    def __init__(
        self, path: str | Path, *, max_length: int | None = None, raw_fp8: bool = False
    ) -> None:
        """`raw_fp8=True`: fp8 runs hand back the stored fp8 states plus `*_scale` tensors
        instead of bf16 (the default for both formats)."""
        self.root = Path(path)
        self.raw_fp8 = raw_fp8
        if not self.root.is_dir():
            raise OutputError(f"{self.root} is not a directory")
        if (self.root / MANIFEST).exists():
            self.items = read_manifest(self.root)
        else:
            log.warning("no_manifest", root=str(self.root), hint="hsq export --format manifest")
            self.items = scan_outputs(self.root)
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.items)

    @property
    def lengths(self) -> list[int]:
        """Token counts (before `max_length`), for length-bucketed batches: from the
        manifest, or without one from each file's header (read once, then kept)."""
        if any(i.num_tokens < 0 for i in self.items):
            self.items = [
                i if i.num_tokens >= 0 else replace(i, num_tokens=header_tokens(self.root, i))
                for i in self.items
            ]
        return [i.num_tokens for i in self.items]

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.items[index]
        out = open_output(self.root / item.relpath, raw=self.raw_fp8)
        if out.sample_id != item.sample_id:
            raise OutputError(f"{item.relpath} holds {out.sample_id!r}, not {item.sample_id!r}")
        return item_of(item.sample_id, out, self.max_length)


def item_of(sample_id: str, out: OutputSample, max_length: int | None) -> dict[str, Any]:
    """A dataset item from an opened output (views, no copies), T cut to `max_length`: the
    one shape of an item, for HiddenStateDataset and StreamingHiddenStateDataset."""
    n = max_length
    extra = {}
    if out.last_hidden_state_prenorm is not None:
        extra[PRENORM] = out.last_hidden_state_prenorm[:n]
    return {
        "id": sample_id,
        "input_ids": out.input_ids[:n],
        "loss_mask": out.loss_mask[:n],
        "aux_hidden_states": out.aux_hidden_states[:n],
        "last_hidden_state": out.last_hidden_state[:n],
        **extra,
        **{name: scale[:n] for name, scale in out.scales.items()},
    }


def collate(batch: Sequence[dict[str, Any]], pad_token_id: int = 0) -> dict[str, Any]:
    """Right-pad to the longest item: input_ids with pad_token_id, the rest with zeros;
    `attention_mask` is 1 on real tokens (loss_mask is 0 on padding)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    out: dict[str, Any] = {"id": [b["id"] for b in batch]}
    keys = (*KEYS, PRENORM) if all(PRENORM in b for b in batch) else KEYS
    for key in keys:
        pad = pad_token_id if key == "input_ids" else 0
        out[key] = pad_sequence([b[key] for b in batch], batch_first=True, padding_value=pad)
    lengths = torch.tensor([b["input_ids"].shape[0] for b in batch])
    out["attention_mask"] = (
        torch.arange(out["input_ids"].shape[1])[None] < lengths[:, None]
    ).long()
    return out
