"""A misbehaving inference server for tests: real HTTP (a thread of the test process), real
dumps written with hsq.dump.write.write_dump into a real dump dir, and a per-request hook that
damages them the way a broken or hostile server would (a FIFO as the tensor file, two full
dumps for one rid). A real `hsq worker` process talks to it like to any server."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hsq.dump.format import DumpMeta, ModelIdentity, fingerprint
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.dump.write import write_dump
from hsq.engines.http_api import ApiServer, prefill_answer, sglang_routes
from tests.support.fakedump import random_states, request_meta

IDENT = ModelIdentity("hostile", "LlamaForCausalLM", 8, 16, "7" * 64)
LAYERS = [2, 4, 5]
HIDDEN = 16
DTYPE = "bfloat16"

Writer = Callable[["HostileServer", int, list[int], str], None]
"""(server, request number, input ids, rid): write this request's dump(s)."""


def meta_for(ids: list[int], rid: str) -> DumpMeta:
    return request_meta(ids, rid, model=IDENT, layer_ids=LAYERS, hidden_size=HIDDEN, dtype=DTYPE)


def tensors_for(ids: list[int]) -> dict[str, torch.Tensor]:
    return random_states(len(ids), len(LAYERS), HIDDEN, DTYPE, seed=sum(ids) + len(ids))


class HostileServer:
    """/generate writes the request's dump through ``writer`` (a good dump by default)."""

    def __init__(self, dump_dir: Path, writer: Writer | None = None) -> None:
        self.dump_dir = dump_dir
        self.writer = writer or HostileServer.good
        self._index = itertools.count()
        self._calls = itertools.count()
        self._lock = threading.Lock()
        dump_dir.mkdir(mode=0o700, exist_ok=True)
        write_ready(dump_dir, ReadyMarker(tuple(LAYERS), IDENT, "hostile", "0", "0", 1, 0.0))
        routes = sglang_routes(self.generate, dict, dict)  # /server_info, /model_info: {}
        self._http = ApiServer(("127.0.0.1", 0), routes)
        self.url = self._http.url
        self._http.serve_in_thread()

    def next_index(self) -> int:
        with self._lock:
            return next(self._index)

    def good(self, _call: int, ids: list[int], rid: str) -> None:
        write_dump(self.dump_dir, self.next_index(), meta_for(ids, rid), tensors_for(ids))

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        ids, rid = list(body["input_ids"]), str(body["rid"])
        with self._lock:
            call = next(self._calls)
        self.writer(self, call, ids, rid)
        return prefill_answer(rid, len(ids), 0.0)

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def once_per_sample(damage: Writer) -> Writer:
    """``damage`` for the first request of each distinct input, a good dump after that."""
    seen: set[str] = set()
    lock = threading.Lock()

    def writer(srv: HostileServer, call: int, ids: list[int], rid: str) -> None:
        fp = fingerprint(ids)
        with lock:
            first = fp not in seen
            seen.add(fp)
        (damage if first else HostileServer.good)(srv, call, ids, rid)

    return writer
