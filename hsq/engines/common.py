"""What every engine (the reference server, the SGLang hook, the vLLM connector) shares:
the model identity a dump carries, the context every dump of one server shares, the
numbered write of one request's dump, and the readiness marker (the launchers' shared
flags and steps are hsq/engines/launch.py: `hsq launch-* --help` loads no dump format).

No torch here, and nothing that imports it: SGLang's launcher and `hsq launch-sglang`
load the engines' settings before torch is loaded (tests/test_layers.py probes it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import hsq
from hsq.dump.format import (
    DUMP_PREFIX,
    TMP_SUFFIX,
    DumpMeta,
    ModelIdentity,
    dtype_name,
    expected_shapes,
    fingerprint,
)
from hsq.dump.ready import READY_FILE, ReadyMarker, write_ready
from hsq.dump.write import first_free_index, write_dump
from hsq.states import PLAIN

if TYPE_CHECKING:
    import torch

MAX_INDEX_TRIES = 1000
"""req_<N> indices a write tries before it gives up: another writer or an old run's dump
may hold the next ones."""


# ------------------------------------------------------------------------ model identity


def config_digest(config: Mapping[str, Any], extra: str = "") -> str:
    """sha256 of the HF config dict as sorted JSON (values JSON cannot hold as their
    str()), then `extra`: every engine takes it, so the same checkpoint has one identity
    whichever server loaded it. The reference server's random shapes add their seed."""
    blob = json.dumps(dict(config), sort_keys=True, default=str) + extra
    return hashlib.sha256(blob.encode()).hexdigest()


def model_identity(
    model_path: str, architecture: str, num_layers: int, hidden_size: int, config: Mapping[str, Any]
) -> ModelIdentity:
    """The identity of a checkpoint a server loaded: its directory's name, its class, its
    shape and its config's digest."""
    return ModelIdentity(
        name=PurePath(model_path.rstrip("/")).name or model_path,
        architecture=architecture,
        num_layers=int(num_layers),
        hidden_size=int(hidden_size),
        config_digest=config_digest(config),
    )


# ------------------------------------------------------------------------ dumps


@dataclass(frozen=True)
class DumpContext:
    """What every dump of one server shares."""

    model: ModelIdentity
    layer_ids: Sequence[int]
    """The aux layers as every dump records them (HF hidden_states indices), in the aux
    tensor's order."""
    encoding: str = PLAIN
    """`plain`, or `fp8-e4m3`: the server quantizes the states as fp8 outputs store them."""
    prenorm: bool = False
    """Every dump holds the final norm's input too."""

    def shapes(self, num_tokens: int, hidden_size: int) -> dict[str, list[int]]:
        """The tensors a dump of `num_tokens` tokens holds, and their shapes."""
        return expected_shapes(
            num_tokens,
            len(self.layer_ids),
            hidden_size,
            encoding=self.encoding,
            prenorm=self.prenorm,
        )

    def meta(
        self,
        index: int,
        rid: str,
        input_fingerprint: str,
        num_tokens: int,
        hidden_size: int,
        dtype: str,
    ) -> DumpMeta:
        """meta.json of one request's dump; `dtype`: what the states were (for fp8, what
        they were quantized from)."""
        return DumpMeta(
            rid=rid,
            num_tokens=num_tokens,
            input_fingerprint=input_fingerprint,
            layer_ids=list(self.layer_ids),
            hidden_size=hidden_size,
            dtype=dtype,
            model=self.model,
            tensors=self.shapes(num_tokens, hidden_size),
            request_index=index,
            encoding=self.encoding,
            prenorm=self.prenorm,
        )

    def ready_marker(self, server: str, server_version: str) -> ReadyMarker:
        """The readiness marker of a server whose dumps have this context."""
        return ReadyMarker(
            layer_ids=tuple(self.layer_ids),
            model=self.model,
            server=server,
            server_version=server_version,
            hook_version=hsq.__version__,
            pid=os.getpid(),
            created_unix=time.time(),
            encoding=self.encoding,
            prenorm=self.prenorm,
        )


class DumpFiles:
    """One server's dump dir as its writers see it: each request's dump under the next
    free req_<N> (taken under a lock: vLLM writes from several threads), then announced
    with the readiness marker. A dump that cannot be written is logged and counted
    (`errors`), never raised: the worker then sees no dump for its rid and retries the
    sample, never a wrong one."""

    def __init__(
        self, dump_dir: Path, ctx: DumpContext, *, fsync: bool, log: logging.Logger, tag: str
    ) -> None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        self.dump_dir = dump_dir
        self.ctx = ctx
        self.fsync = fsync
        self.errors = 0
        self._log = log
        self._tag = tag
        self._lock = threading.Lock()
        self._next = first_free_index(dump_dir)

    def _take_index(self) -> int:
        with self._lock:
            index, self._next = self._next, self._next + 1
            return index

    def store(
        self,
        rid: str,
        token_ids: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
        *,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> Path | None:
        """Write one request's dump (tensors of the context's shapes); its path, or None."""
        num_tokens = int(token_ids.shape[0])
        fp = fingerprint(token_ids)
        for _ in range(MAX_INDEX_TRIES):
            index = self._take_index()
            meta = self.ctx.meta(index, rid, fp, num_tokens, int(hidden_size), dtype_name(dtype))
            try:
                return write_dump(self.dump_dir, index, meta, tensors, fsync=self.fsync)
            except FileExistsError:
                continue  # an old run's dump (or another writer) holds this index
            except OSError as exc:
                self.errors += 1
                self._log.error("%s: writing %s failed: %s", self._tag, rid, exc)
                # Its req_<N>.tmp is this writer's (an index held by another raised
                # FileExistsError above): a torn write left on a full tmpfs would hold the
                # space every later dump needs until the server restarts.
                shutil.rmtree(
                    self.dump_dir / f"{DUMP_PREFIX}{index}{TMP_SUFFIX}", ignore_errors=True
                )
                return None
        self.errors += 1
        self._log.error("%s: no free req_<N> index for %s", self._tag, rid)
        return None

    def announce(self, server: str, server_version: str) -> Path:
        """The readiness marker the worker waits for (hsq.dump.ready)."""
        marker = self.ctx.ready_marker(server, server_version)
        return write_ready(self.dump_dir, marker, fsync=self.fsync)


def forget_marker(dump_dir: Path) -> None:
    """A marker an earlier server left must not vouch for this one while it loads."""
    (dump_dir / READY_FILE).unlink(missing_ok=True)
