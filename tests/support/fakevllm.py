"""A vLLM-shaped server for tests and the live script's CPU dry run: vLLM's completions
API over HTTP, a transformers forward on the CPU, and hsq's real connector core writing
the dumps. Not vLLM: it stands in for the part of vLLM the worker talks to.

What it mimics, read in vLLM 0.26.0: ``POST /v1/completions`` with ``prompt`` as token
ids answers ``usage.prompt_tokens`` (and ``prompt_tokens_details``) and the connector's
``kv_transfer_params``; ``GET /health``. The capture is extract_hidden_states' rule
(hsq/engines/vllm/layers.py): id ``i < L`` is HF ``hidden_states[i]``, id ``L`` the final
state before the norm, stacked ``[T, k, H]`` in ascending id order, handed to the writer
**after** the answer is sent (vLLM saves one engine step after the request finishes).

    python -m tests.support.fakevllm --model DIR --dump-dir D --port P --layers 2,4,5

or vLLM's own command line, as `hsq launch-vllm` writes it (`serve MODEL --port P
--kv-transfer-config JSON ...`: the connector's settings come from that JSON, the rest is
vLLM's and ignored), for `hsq run --engine vllm` through `hsq launch-vllm --python` (a
script that drops the `-m vllm.entrypoints.cli.main` and runs this module instead).
"""

from __future__ import annotations

import argparse
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hsq.engines.common import model_identity
from hsq.engines.http_api import ApiServer, Handler, Reply, RequestError, Route
from hsq.engines.vllm.config import ConnectorConfig
from hsq.engines.vllm.core import ConnectorCore, rid_of
from hsq.engines.vllm.layers import vllm_aux_ids
from hsq.engines.vllm.refusals import ServingFacts
from hsq.states import ENCODINGS, PLAIN

MAX_BODY = 8 << 20


class FakeVllm:
    def __init__(self, model_dir: Path, cfg: ConnectorConfig) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(2)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        config = self.model.config
        self.num_layers = int(config.num_hidden_layers)
        arch = str((config.architectures or ["LlamaForCausalLM"])[0])
        facts = ServingFacts(
            architecture=arch,
            num_layers=self.num_layers,
            hidden_size=int(config.hidden_size),
            captured_ids=vllm_aux_ids(cfg.layer_ids, self.num_layers),
            enable_prefix_caching=False,
            cache_dtype="auto",
        )
        ident = model_identity(
            str(model_dir), arch, self.num_layers, facts.hidden_size, config.to_dict()
        )
        self.core = ConnectorCore(cfg, facts, ident, str(model_dir))
        self.core.start_writer("fake-vllm")
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="vllm-hs-save")  # as vLLM's
        self.lock = threading.Lock()  # one forward at a time: bit-stable CPU results

    def rows(self, ids: list[int]) -> torch.Tensor:
        seen: dict[str, torch.Tensor] = {}
        last = self.model.model.layers[-1]
        hook = last.register_forward_hook(
            lambda _m, _a, out: seen.__setitem__("pre", out[0] if isinstance(out, tuple) else out)
        )
        try:
            with self.lock, torch.inference_mode():
                out = self.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        finally:
            hook.remove()
        hs = out.hidden_states
        stack = [hs[i][0] if i < self.num_layers else seen["pre"][0] for i in self.core.captured]
        return torch.stack(stack, dim=1).to(torch.bfloat16)

    def complete(self, body: Any) -> Reply:
        body = body if isinstance(body, dict) else {}
        ids = body.get("prompt")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise RequestError("prompt must be token ids")
        rid = rid_of(body.get("kv_transfer_params"))
        rows = self.rows(ids)
        answer = {
            "id": f"cmpl-{body.get('request_id', 'x')}",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": 1,
                "total_tokens": len(ids) + 1,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            "kv_transfer_params": {"hsq_rid": rid} if rid else None,
        }

        def save() -> None:
            if rid is not None:
                key = f"cmpl-{rid}"
                self.core.remember(key, rid)
                tensors = {"hidden_states": rows, "token_ids": torch.tensor(ids)}
                self.core.write_tensors(tensors, _Ready(), key)

        def later() -> None:  # once the answer is written, as vLLM's next engine step
            self.pool.submit(save)

        return Reply(answer, later)

    def routes(self) -> dict[Route, Handler]:
        return {("POST", "/v1/completions"): self.complete, ("GET", "/health"): lambda _: {}}


class _Ready:
    def synchronize(self) -> None:
        pass


def from_vllm_argv(argv: list[str]) -> tuple[Path, int, ConnectorConfig]:
    """(model, port, the connector's config) of `serve MODEL ... --port P
    --kv-transfer-config JSON ...`."""
    p = argparse.ArgumentParser(prog="vllm")
    p.add_argument("serve")
    p.add_argument("model", type=Path)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kv-transfer-config", required=True)
    args, _vllms_own = p.parse_known_args(argv)
    extra = json.loads(args.kv_transfer_config)["kv_connector_extra_config"]
    return args.model, args.port, ConnectorConfig.from_extra(extra)


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        model, port, cfg = from_vllm_argv(argv)
        serve(FakeVllm(model, cfg), port, cfg.dump_dir)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dump-dir", type=Path, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--layers", required=True, help="the run's aux layers, e.g. 2,4,5")
    p.add_argument("--prenorm", action="store_true")
    p.add_argument("--dump-encoding", choices=ENCODINGS, default=PLAIN)
    args = p.parse_args(argv)
    cfg = ConnectorConfig(
        dump_dir=args.dump_dir,
        layer_ids=tuple(int(i) for i in args.layers.split(",")),
        encoding=args.dump_encoding,
        prenorm=args.prenorm,
    )
    serve(FakeVllm(args.model, cfg), args.port, args.dump_dir)


def serve(app: FakeVllm, port: int, dump_dir: Path) -> None:
    server = ApiServer(("127.0.0.1", port), app.routes(), max_body_bytes=MAX_BODY)
    print(f"fake vLLM at http://127.0.0.1:{port}, dumping to {dump_dir}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
