"""A server whose model costs nothing: the worker's ceiling, measured against it.

Same HTTP API as the reference server for what a worker uses (POST /generate with
input_ids and rid, GET /health, /server_info, /model_info; POST /admin/reset clears the
counts and times /server_info reports), the readiness marker, and one
valid dump per request written with hsq.dump.write.write_dump at once: the hidden states are
slices of one preallocated buffer of random, finite values of the chosen shape (H, k aux
layers + the last state, dtype). Everything a worker checks holds: rid, fingerprint, token
count, layers, model identity, shapes, dtype, finite values. `--dump-encoding fp8-e4m3`
makes server-made fp8 dumps (float8 values and float32 row scales, quantized once at start
with hsq.quant, as a real server's hook would send them): half the bytes per token.

    python -m tests.support.nullserver --dump-dir /dev/shm/hsq-null/d0 --port 30000 \\
        --hidden-size 4096 --num-layers 32 --dtype bfloat16

bench/ceiling.py starts it through tests.support.procs.NullServer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hsq.dump.format import ModelIdentity, expected_shapes
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.dump.write import write_dump
from hsq.engines.http_api import ApiServer, Handler, Route, prefill_answer, sglang_routes
from hsq.states import ENCODINGS, FP8, PLAIN, scale_name, state_tensors
from tests.support.fakedump import random_states, request_meta

SHAPES = {
    # name: (hidden size, decoder layers)
    "tiny": (64, 8),
    "8b": (4096, 32),
    "kimi-k2.5": (7168, 61),
}


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers (HF hidden_states indices), as the reference server."""
    return [2, num_layers // 2, num_layers - 3]


class NullModel:
    """The preallocated states and the identity every dump carries."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_layers: int,
        layer_ids: list[int],
        dtype: str,
        max_tokens: int,
        name: str,
        seed: int = 0,
        encoding: str = PLAIN,
    ) -> None:
        self.hidden_size = hidden_size
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self.encoding = encoding
        self.max_tokens = max_tokens
        self.identity = ModelIdentity(
            name=name,
            architecture="NullModel",
            num_layers=num_layers,
            hidden_size=hidden_size,
            # Not the seed: servers with other values but the same shape are one model.
            config_digest=f"null-{hidden_size}-{num_layers}-{dtype}".ljust(16, "0"),
        )
        # A request takes the first rows.
        states = random_states(max_tokens, len(self.layer_ids), hidden_size, dtype, seed)
        if encoding == FP8:  # quantized once, row by row: a row's slice stays a valid dump
            from hsq.quant import quantize

            fp8: dict[str, Any] = {}
            for tname, groups in state_tensors(len(self.layer_ids), False):
                fp8[tname], fp8[scale_name(tname)] = quantize(states[tname], groups)
            states = fp8
        self.states = states

    def tensors(self, n: int) -> dict[str, Any]:
        return {name: t[:n] for name, t in self.states.items()}

    def shapes(self, n: int) -> dict[str, list[int]]:
        return expected_shapes(n, len(self.layer_ids), self.hidden_size, encoding=self.encoding)


class NullApp:
    def __init__(
        self, model: NullModel, dump_dir: Path, *, fsync: bool, answer_delay_s: float = 0.0
    ) -> None:
        self.model = model
        self.dump_dir = dump_dir
        self.fsync = fsync
        self.answer_delay_s = answer_delay_s
        self._lock = threading.Lock()
        self.counter = 0
        self.requests = 0
        self.tokens = 0
        self.first_request_unix: float | None = None
        self.last_request_unix: float | None = None

    def generate(self, body: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list):
            raise ValueError("input_ids (a list of ints) is required")
        ids = body["input_ids"]
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise ValueError("rid (a string) is required: the null server dumps by rid")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict) or params.get("max_new_tokens", 0) != 0:
            raise ValueError("only prefill is supported: sampling_params.max_new_tokens=0")
        n = len(ids)
        if not 0 < n <= self.model.max_tokens:
            raise ValueError(f"{n} tokens; this server takes 1..{self.model.max_tokens}")
        now = time.time()
        with self._lock:
            index = self.counter
            self.counter += 1
            if self.first_request_unix is None:
                self.first_request_unix = now
            self.last_request_unix = now
        m = self.model
        meta = request_meta(
            ids,
            rid,
            model=m.identity,
            layer_ids=m.layer_ids,
            hidden_size=m.hidden_size,
            dtype=m.dtype,
            index=index,
        )
        if m.encoding != PLAIN:
            meta = replace(meta, encoding=m.encoding, tensors=m.shapes(n), format_version=0)
        write_dump(self.dump_dir, index, meta, m.tensors(n), fsync=self.fsync)
        with self._lock:
            self.requests += 1
            self.tokens += n
        if self.answer_delay_s > 0:  # tests: the dump is there, the answer comes later
            time.sleep(self.answer_delay_s)
        return prefill_answer(rid, n, time.perf_counter() - t0)

    def routes(self) -> dict[Route, Handler]:
        return {
            **sglang_routes(self.generate, self.server_info, self.model_info),
            ("POST", "/admin/reset"): lambda _body: self.reset_stats(),
        }

    def reset_stats(self) -> None:
        """Forget the request counts and times (not the dump counter): one bench run each."""
        with self._lock:
            self.requests = self.tokens = 0
            self.first_request_unix = self.last_request_unix = None

    def server_info(self) -> dict[str, Any]:
        with self._lock:
            return {
                "server": "hsq-null",
                "disable_radix_cache": True,
                "chunked_prefill_size": -1,
                "max_tokens": self.model.max_tokens,
                "dump_dir": str(self.dump_dir),
                "request_counter": self.counter,
                "requests_served": self.requests,
                "tokens_served": self.tokens,
                "first_request_unix": self.first_request_unix,
                "last_request_unix": self.last_request_unix,
            }

    def model_info(self) -> dict[str, Any]:
        m = self.model
        return {
            "model_path": m.identity.name,
            "tokenizer_path": None,
            "is_generation": True,
            "architectures": [m.identity.architecture],
            "hsq": {
                "model_id": m.identity.model_id,
                "layer_ids": m.layer_ids,
                "hidden_size": m.hidden_size,
                "dump_dtype": m.dtype,
                "dump_encoding": m.encoding,
            },
        }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump-dir", type=Path, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="sets H and layers")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--layers", default=None, help="aux layer ids, comma separated")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--dump-encoding", default=PLAIN, choices=ENCODINGS)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--name", default=None, help="model name in the identity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fsync", action="store_true", help="fsync dumps (tmpfs needs none)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (start-up only)")
    ap.add_argument(
        "--answer-delay-s", type=float, default=0.0, help="answer this long after the dump"
    )
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, args.threads))
    hidden, layers_n = SHAPES[args.shape] if args.shape else (args.hidden_size, args.num_layers)
    layer_ids = (
        [int(x) for x in args.layers.split(",")] if args.layers else default_layers(layers_n)
    )
    model = NullModel(
        hidden_size=hidden,
        num_layers=layers_n,
        layer_ids=layer_ids,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        name=args.name or f"null-{args.shape or hidden}",
        seed=args.seed,
        encoding=args.dump_encoding,
    )
    args.dump_dir.mkdir(parents=True, exist_ok=True)
    import hsq

    marker = ReadyMarker(
        layer_ids=tuple(layer_ids),
        model=model.identity,
        server="hsq-null",
        server_version=hsq.__version__,
        hook_version=hsq.__version__,
        pid=os.getpid(),
        created_unix=time.time(),
        encoding=args.dump_encoding,
    )
    write_ready(args.dump_dir, marker, fsync=args.fsync)  # before /health answers
    app = NullApp(model, args.dump_dir, fsync=args.fsync, answer_delay_s=args.answer_delay_s)
    # A bad request is a ValueError from generate(): 400, as the reference server answers.
    server = ApiServer(
        (args.host, args.port), app.routes(), refusals={ValueError: 400}, backlog=128
    )
    print(json.dumps({"event": "ready", "port": args.port, "model_id": model.identity.model_id}))
    server.serve_until_signal()


if __name__ == "__main__":
    main()
    # Stopped and answered everything: skip the interpreter's teardown (seconds with torch).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
