"""A misbehaving inference server for tests: real HTTP (a thread of the test process), real
dumps written with hsq.dump.write.write_dump into a real dump dir, and a per-request hook that
damages them the way a broken or hostile server would (a FIFO as the tensor file, two full
dumps for one rid). Its connections can misbehave too (`Wire`): closed under a request on
a kept-alive connection, closed right after each answer without `Connection: close`,
answers cut short of their Content-Length or trickled a byte at a time. A real `hsq
worker` process talks to it like to any server."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsq.dump.format import DumpMeta, ModelIdentity, fingerprint
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.dump.write import write_dump
from hsq.engines.http_api import ApiServer, _Handler, prefill_answer, sglang_routes
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


WHOLE, CUT, CUT_PARSABLE, TRICKLE = "whole", "cut", "cut_parsable", "trickle"
"""How a /generate answer goes out (`Wire.answer`): whole; the body cut in half, then the
connection closed; a body that parses as JSON but stops short of its Content-Length (the
rest is padding), then closed; the whole answer a byte at a time (`Wire.trickle_s`)."""


@dataclass
class Wire:
    """How a HostileServer's connections misbehave (nothing, by default). Never with a
    `Connection: close` header: the client learns of each close from the socket alone."""

    answers_per_connection: int | None = None
    """After this many answers on one connection, the next request on it gets no answer:
    the connection closes under it, as a keep-alive timeout that crossed the request."""
    dump_unanswered: bool = False
    """With `answers_per_connection`: that request is read and its dump written first,
    with other values than a good dump's (no worker may ever store them)."""
    close_after_answer: bool = False
    """Close each connection right after its first answer, ``close_delay_s`` after it (the
    worker may send its next request before the close arrives: an idle timeout's race)."""
    close_delay_s: float = 0.0
    answer: Callable[[list[int]], str] = lambda _ids: WHOLE
    """Input ids -> how the /generate answer goes out (WHOLE, CUT, CUT_PARSABLE, TRICKLE)."""
    trickle_s: float = 0.1


class _WireServer(ApiServer):
    hostile: HostileServer


class _WireHandler(_Handler):
    """The ApiServer's handler, misbehaving as the server's `Wire` says."""

    server: _WireServer

    def setup(self) -> None:
        super().setup()
        self.answered = 0

    def _handle(self, method: str) -> None:
        hostile = self.server.hostile
        wire = hostile.wire
        limit = wire.answers_per_connection
        if limit is not None and self.answered >= limit:
            if wire.dump_unanswered and method == "POST":
                hostile.unanswered(self._body())
            hostile.note("closed_under")
            self.close_connection = True  # nothing sent: the connection closes under it
            return
        super()._handle(method)
        self.answered += 1
        if wire.close_after_answer:
            time.sleep(wire.close_delay_s)
            self.close_connection = True

    def _send(self, status: int, body: Any) -> None:
        rid = body.get("meta_info", {}).get("id") if isinstance(body, dict) else None
        how = self.server.hostile.answers.pop(rid, WHOLE) if isinstance(rid, str) else WHOLE
        if how == WHOLE:
            super()._send(status, body)
            return
        data = json.dumps(body).encode()
        declared = len(data) + 64 if how == CUT_PARSABLE else len(data)  # padding never sent
        head = f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\n"
        raw = head.encode() + b"content-length: %d\r\n\r\n" % declared + data
        if how in (CUT, CUT_PARSABLE):
            self.close_connection = True
            self.wfile.write(raw[: len(raw) - len(data) // 2] if how == CUT else raw)
            return
        try:  # TRICKLE, on a connection kept alive after it
            for i in range(len(raw)):
                self.wfile.write(raw[i : i + 1])
                self.wfile.flush()
                time.sleep(self.server.hostile.wire.trickle_s)
        except OSError:  # the client gave up on it
            self.close_connection = True
            return
        self.server.hostile.note("trickled_whole")


class HostileServer:
    """/generate writes the request's dump through ``writer`` (a good dump by default);
    its connections misbehave as ``wire`` says."""

    def __init__(
        self, dump_dir: Path, writer: Writer | None = None, wire: Wire | None = None
    ) -> None:
        self.dump_dir = dump_dir
        self.writer = writer or HostileServer.good
        self.wire = wire or Wire()
        self.answers: dict[str, str] = {}
        """rid -> how its answer goes out (Wire.answer), until it went."""
        self.closed_under = 0
        """Requests whose connection was closed under them, unanswered."""
        self.unanswered_rids: list[str] = []
        """Rids of those whose dump was written all the same (Wire.dump_unanswered)."""
        self.trickled_whole = 0
        """Trickled answers that went out whole (the client waited for every byte)."""
        self._index = itertools.count()
        self._calls = itertools.count()
        self._lock = threading.Lock()
        dump_dir.mkdir(mode=0o700, exist_ok=True)
        write_ready(dump_dir, ReadyMarker(tuple(LAYERS), IDENT, "hostile", "0", "0", 1, 0.0))
        routes = sglang_routes(self.generate, dict, dict)  # /server_info, /model_info: {}
        self._http = _WireServer(("127.0.0.1", 0), routes)
        self._http.hostile = self
        self._http.RequestHandlerClass = _WireHandler
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
        how = self.wire.answer(ids)
        if how != WHOLE:
            with self._lock:
                self.answers[rid] = how
        return prefill_answer(rid, len(ids), 0.0)

    def note(self, counter: str) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def unanswered(self, body: dict[str, Any]) -> None:
        """A request the connection closes under, seen by the server all the same: its dump
        holds other values than a good one (seeded apart), so a worker that stored it
        would store states that are not the sample's."""
        ids, rid = list(body["input_ids"]), str(body["rid"])
        states = random_states(len(ids), len(LAYERS), HIDDEN, DTYPE, seed=sum(ids) + 1_000_003)
        write_dump(self.dump_dir, self.next_index(), meta_for(ids, rid), states)
        with self._lock:
            self.unanswered_rids.append(rid)

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
