"""The reference server's core: batched prefill, a persistent dump counter, faults.

No HTTP here; app.py translates requests into `Engine.generate` calls, one thread each.
Concurrent requests are gathered the way SGLang's scheduler does it, without a wait window:
while one forward runs, new requests queue; the next thread to take the forward lock runs
up to --max-batch-requests of them (at most --max-batch-tokens tokens, but always at least
one) as one right-padded forward, then splits the states per request, one dump each.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from hsq.dump.format import (
    DUMP_PREFIX,
    TENSOR_FILE,
    TMP_SUFFIX,
    DumpMeta,
    dtype_name,
    fingerprint,
)
from hsq.engines.common import DumpContext
from hsq.engines.http_api import RequestError, prefill_answer
from hsq.engines.reference.dumper import DumpPart, DumpWriter, HostBatch
from hsq.engines.reference.faults import MIXING, FaultPlan, FaultRule, mix_sources
from hsq.engines.reference.model import Captured, HiddenStateModel, batch_shapes
from hsq.quant import quantize_on_device
from hsq.states import (
    AUX_TENSOR,
    FP8,
    LAST_TENSOR,
    PLAIN,
    PRENORM_TENSOR,
    scale_name,
    state_tensors,
)

log = structlog.get_logger("hsq.reference.engine")
CRASH_EXIT_CODE = 70


class InjectedServerError(RuntimeError):
    """The http_500 fault."""


@dataclass
class GenerateResult:
    rid: str
    prompt_tokens: int
    index: int
    forward_s: float
    batch_size: int = 1
    fault: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_sglang(self, e2e_s: float) -> dict[str, Any]:
        """The shape of SGLang's /generate answer for a prefill-only request."""
        return prefill_answer(self.rid, self.prompt_tokens, e2e_s)


@dataclass
class _Pending:
    """One request waiting for (or inside) a batch; `done` is set once it has a result."""

    ids: list[int]
    rid: str
    fp: str
    rule: FaultRule | None
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerateResult | None = None
    error: BaseException | None = None


def _corrupt(tmp: Path) -> None:
    (tmp / TENSOR_FILE).write_bytes(b"\x00garbage, not safetensors")


class Engine:
    def __init__(
        self,
        model: HiddenStateModel,
        writer: DumpWriter,
        faults: FaultPlan,
        *,
        max_tokens: int,
        counter_start: int = 0,
        max_batch_requests: int = 1,
        max_batch_tokens: int = 0,
        encoding: str = PLAIN,
    ) -> None:
        self.model = model
        self.writer = writer
        self.faults = faults
        self.encoding = encoding
        self.ctx = DumpContext(model.identity, model.layer_ids, encoding, model.prenorm)
        """What every dump of this server shares."""
        self.max_tokens = max_tokens
        self.max_batch_requests = max(1, max_batch_requests)
        self.max_batch_tokens = max_batch_tokens or max_tokens
        self._counter = counter_start
        self._lock = threading.Lock()  # one forward at a time, like one GPU
        self._queue_lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._gate = threading.Event()  # cleared by pause(): tests line up a batch
        self._gate.set()
        self._previous: tuple[str, str] | None = None
        self.requests = 0
        self.batches = 0

    @property
    def counter(self) -> int:
        return self._counter

    def validate(self, input_ids: Any) -> list[int]:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of integers")
        if any(type(t) is not int for t in input_ids):
            raise RequestError("input_ids must contain integers only")
        if len(input_ids) > self.max_tokens:
            raise RequestError(
                f"input has {len(input_ids)} tokens, more than --max-tokens {self.max_tokens}"
            )
        vocab = self.model.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise RequestError(f"token ids must be within [0, {vocab})")
        return input_ids

    def generate(self, input_ids: list[int], rid: str | None = None) -> GenerateResult:
        ids = self.validate(input_ids)
        rid = rid or uuid.uuid4().hex
        fp = fingerprint(ids)
        rule = self.faults.pick(fp)
        if rule is not None and rule.mode == "slow":
            time.sleep(rule.seconds)
        if rule is not None and rule.mode == "http_500":
            raise InjectedServerError("injected fault: http_500")
        mine = _Pending(ids, rid, fp, rule)
        with self._queue_lock:
            self._pending.append(mine)
        # Whoever holds the forward lock runs the oldest pending requests, ours or not;
        # we are done once some batch has included ours.
        while not mine.done.is_set():
            with self._lock:
                self._gate.wait()
                if mine.done.is_set():
                    break
                batch = self._take()
                if batch:
                    self._run(batch)
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        return mine.result

    @property
    def pending(self) -> int:
        with self._queue_lock:
            return len(self._pending)

    def pause(self) -> None:
        """Hold forwards (requests queue up) until resume(): lets a test or an operator
        line up an exact batch without relying on timing."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def _take(self) -> list[_Pending]:
        with self._queue_lock:
            # The budget counts padded tokens (requests x the longest): that is what the
            # forward computes and holds in activation memory.
            batch: list[_Pending] = []
            longest = 0
            while self._pending and len(batch) < self.max_batch_requests:
                n = len(self._pending[0].ids)
                if batch and (len(batch) + 1) * max(longest, n) > self.max_batch_tokens:
                    break
                batch.append(self._pending.pop(0))
                longest = max(longest, n)
            return batch

    def _run(self, batch: list[_Pending]) -> None:
        """Forward, split and hand to the writer; every request in the batch gets its own
        result or the error (never the thread that happened to run it)."""
        host: HostBatch | None = None
        try:
            for p in batch:
                if p.rule is not None and p.rule.mode == "crash":
                    self._crash(self._counter)
            t0 = time.perf_counter()
            captured = self.model.forward_batch([p.ids for p in batch])
            host = self.writer.to_host(self.encode(captured))
            forward_s = time.perf_counter() - t0
            parts: list[DumpPart] = []
            starts = [0]
            for p in batch:
                starts.append(starts[-1] + len(p.ids))
            sources = mix_sources(
                [len(p.ids) for p in batch],
                [p.rule is not None and p.rule.mode in MIXING for p in batch],
            )
            for i, p in enumerate(batch):
                n = len(p.ids)
                index = self._counter
                src = sources[i]  # i, unless the mix fault hands it another request's states
                if src != i:
                    log.warning("fault_mix", rid=p.rid, states_of=batch[src].rid)
                rows = _rows(host.tensors, starts[i], starts[i] + n)
                if src != i:  # another request's states: all of them, or the pre-norm only
                    theirs = _rows(host.tensors, starts[src], starts[src] + n)
                    only = p.rule is not None and p.rule.mode == "mix_prenorm"
                    rows.update(
                        {
                            k: v
                            for k, v in theirs.items()
                            if not only or k.startswith(PRENORM_TENSOR)
                        }
                    )
                own = self._parts(index, p.rid, p.fp, n, rows, p.rule, host)
                self._counter += len(own)
                self._previous = (p.rid, p.fp)
                parts.extend(own)
                p.result = GenerateResult(
                    rid=p.rid,
                    prompt_tokens=n,
                    index=index,
                    forward_s=forward_s,
                    batch_size=len(batch),
                    fault=p.rule.mode if p.rule else None,
                )
            self.requests += len(batch)
            self.batches += 1
            # Blocks when the writer is behind: backpressure instead of unbounded memory.
            self.writer.submit(parts, host)
        except Exception as exc:
            log.exception("batch_failed", requests=len(batch))
            if host is not None:
                host.wait()
                self.writer.release(host)
            for p in batch:
                p.result, p.error = None, exc
        finally:
            for p in batch:
                p.done.set()

    def encode(self, captured: Captured) -> dict[str, torch.Tensor]:
        """The dump's tensors in file order, on the model's device: the states as they are,
        or quantized there (fp8-e4m3) so that half the bytes cross to the host and the
        worker has nothing to quantize."""
        states = {AUX_TENSOR: captured.aux, LAST_TENSOR: captured.last}
        if captured.prenorm is not None:
            states[PRENORM_TENSOR] = captured.prenorm
        if self.encoding != FP8:
            return states
        out: dict[str, torch.Tensor] = {}
        for name, groups in state_tensors(len(self.model.layer_ids), self.model.prenorm):
            out[name], out[scale_name(name)] = quantize_on_device(states[name], groups)
        return out

    def warmup(self, n: int, num_tokens: int = 16) -> None:
        """What a real server does at start: requests of its own that create dumps."""
        gen = torch.Generator().manual_seed(1234)
        for i in range(n):
            ids = torch.randint(0, self.model.vocab_size, (num_tokens,), generator=gen).tolist()
            self.generate(ids, rid=f"WARMUP_{i}")
        self.writer.flush()

    def warmup_shapes(self) -> int:
        """On CUDA, run one forward of every padded batch shape this engine can form, so a
        shape's first-use cost (a new length took a median 78 ms against 21 ms for a
        repeated one) is paid at start, not inside requests. Returns the shapes run."""
        if self.model.device.type != "cuda":
            return 0
        shapes = batch_shapes(self.max_tokens, self.max_batch_requests, self.max_batch_tokens)
        t0 = time.perf_counter()
        for rows, length in shapes:
            self.model.forward_batch([[0] * length] * rows)
        torch.cuda.synchronize(self.model.device)
        log.info("shapes_warmed", shapes=len(shapes), seconds=round(time.perf_counter() - t0, 1))
        return len(shapes)

    def _meta(self, index: int, rid: str, fp: str, n: int) -> DumpMeta:
        m = self.model
        return self.ctx.meta(index, rid, fp, n, m.hidden_size, dtype_name(m.dump_dtype))

    def _parts(
        self,
        index: int,
        rid: str,
        fp: str,
        n: int,
        tensors: dict[str, torch.Tensor],
        rule: FaultRule | None,
        batch: HostBatch,
    ) -> list[DumpPart]:
        mode = rule.mode if rule else None
        if mode == "split" and n >= 2:
            k = n // 2
            return [
                DumpPart(index, self._meta(index, rid, fp, k), _rows(tensors, 0, k)),
                DumpPart(index + 1, self._meta(index + 1, rid, fp, n - k), _rows(tensors, k, n)),
            ]
        if mode == "wrong_count" and n >= 2:
            return [DumpPart(index, self._meta(index, rid, fp, n - 1), _rows(tensors, 0, n - 1))]
        if mode == "stale":
            old_rid, old_fp = self._previous or ("stale-" + uuid.uuid4().hex, "blake2b128:0")
            return [DumpPart(index, self._meta(index, old_rid, old_fp, n), tensors)]
        if mode == "nan":
            batch.wait()  # the async copy must land first
            tensors = {k: v.clone() for k, v in tensors.items()}
            tensors[AUX_TENSOR][0, 0] = float("nan")
        part = DumpPart(index, self._meta(index, rid, fp, n), tensors)
        part.mark_done = mode != "no_done"
        part.before_done = _corrupt if mode == "corrupt" else None
        return [part]

    def _crash(self, index: int) -> None:
        # Leave what a process killed mid-write leaves: a partial req_<N>.tmp/.
        tmp = self.writer.dump_dir / f"{DUMP_PREFIX}{index}{TMP_SUFFIX}"
        tmp.mkdir(exist_ok=True)
        (tmp / TENSOR_FILE).write_bytes(b"partial")
        log.error("injected_crash", index=index)
        os._exit(CRASH_EXIT_CODE)


def _rows(tensors: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in tensors.items()}
