"""The live phase machinery itself, on a CPU: tests/gpu/phase.py with hsq's reference
server in SGLang's place (a random Llama written by transformers, served by
`hsq serve-reference --model DIR`): enqueue, a worker with K in flight, the server
SIGKILLed mid-run and started again, `verify --deep`, every state against the reference
forward, and every planted fault failing. What the GPU run adds is SGLang itself."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from hsq.node.procs import RedisServer, low_port
from tests.gpu import models
from tests.gpu.phase import Model, Phase, assert_phase
from tests.gpu.results import Results
from tests.gpu.settings import LiveSettings
from tests.support.procs import ReferenceServer

SAMPLES = 20


class ReferenceStandIn:
    """SGLangServer's interface over `hsq serve-reference` (Llama ids: drafter +1)."""

    def __init__(self, model: Path, log: Path, *, dump_dir: Path, layers: str, **_: Any) -> None:
        self.model, self.log, self.dump_dir = model, log, dump_dir
        self.layers = ",".join(str(int(x) + 1) for x in layers.split(","))
        self.port = low_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: ReferenceServer | None = None

    def start(self) -> float:
        args = ["--model", str(self.model), "--device", "cpu", "--no-fsync", "--layers",
                self.layers, "--max-batch-requests", "4", "--threads", "2"]  # fmt: skip
        self.proc = ReferenceServer(self.dump_dir, self.log, port=self.port, args=args)
        self.proc.wait_ready(300)
        return 0.0

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.signal(signal.SIGKILL)
        self.proc.proc.wait(60)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def test_a_phase_end_to_end_with_the_reference_server(tmp_path: Path) -> None:
    path = models.write_llama(tmp_path / "llama", layers=4, hidden=256, seed=0, device="cpu")
    model = Model("llama", path, path, "llama", 4, "0,1,2")
    live = LiveSettings(work=tmp_path, dump_root=None, models=None, results=None,
                        sglang_version=None, samples=SAMPLES, inflight=4)  # fmt: skip
    (tmp_path / "w").mkdir()
    dump = tmp_path / "dumps"
    dump.mkdir(mode=0o700)
    redis = RedisServer(tmp_path / "redis").wait_ready()
    try:
        fig = Phase(model, live, Results(tmp_path / "live.json"), "llama", tmp_path / "w", dump,
                    redis.url, SAMPLES, server_factory=ReferenceStandIn,
                    sglang_version="0.5.15").run()  # fmt: skip
    finally:
        redis.stop()
    assert fig["run"]["killed_with_done"] < SAMPLES and "restart_s" in fig["run"]
    assert_phase(fig, samples=SAMPLES, moe=False)
    assert (tmp_path / "live.json").exists()


def test_an_extraction_whose_samples_die_ends(tmp_path: Path) -> None:
    """The wait counts done and dead: a server that rejects every request (the reference
    server refuses the proxy's one new token) ends the run with every sample dead instead
    of waiting for done samples that never come (the 2026-12-01 live run waited out its
    call this way, or in some other way that was not recorded)."""
    from tests.gpu.extract import Extraction, lengths_mixed, make_dataset
    from tests.gpu.proxy import RoutingProxy

    path = models.write_llama(tmp_path / "llama", layers=4, hidden=256, seed=0, device="cpu")
    dump = tmp_path / "dumps"
    dump.mkdir(mode=0o700)
    srv = ReferenceStandIn(path, tmp_path / "server.log", dump_dir=dump, layers="0,1,2")
    srv.start()
    redis = RedisServer(tmp_path / "redis").wait_ready()
    data = make_dataset(tmp_path / "d.jsonl", lengths_mixed(10, 1, chunk=1024), vocab=32000, seed=2)
    try:
        with RoutingProxy(srv.url, num_layers=4, top_k=2) as proxy:
            ext = Extraction(tmp_path, "dies", data, tmp_path / "d.jsonl", redis.url, srv,
                             proxy.url, "1,2,3", 4)  # fmt: skip
            res = ext.go(kill_at=None)
    finally:
        srv.stop()
        redis.stop()
    assert res["status"]["dead"] == 10 and res["status"]["done"] == 0, res
    assert res["dead_reasons"] == ["rejected"]
