"""What the audit tests share: reference servers batching K requests (one with the `mix`
fault, one clean), a worker whose first K requests form one batch, a dataset of one length
(mixed states then pass every check the worker makes), and `hsq audit` run and read."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from hsq.node.procs import ManagedProcess
from hsq.producer.synthetic import write_synthetic
from tests.helpers import hsq, log_events, start_worker, wait_until
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
N = 12
K = 4


@pytest.fixture(scope="module")
def mixing(server_factory: Factory) -> ReferenceServer:
    return server_factory(
        "--max-batch-requests", str(K), "--fault", "mix", name="mixsrv"
    ).wait_ready()


@pytest.fixture(scope="module")
def clean(server_factory: Factory) -> ReferenceServer:
    return server_factory("--max-batch-requests", str(K), name="cleansrv").wait_ready()


def info(server: ReferenceServer) -> dict[str, int]:
    data: dict[str, int] = httpx.get(server.url + "/server_info", timeout=10).json()
    return data


def extract_batched(
    tmp: Path, run: str, server: ReferenceServer, redis_url: str, *extra: str
) -> ManagedProcess:
    """A --burst worker with K in flight whose first K requests form one batch."""
    httpx.post(server.url + "/admin/pause", timeout=10).raise_for_status()
    try:
        w = start_worker(tmp, run, server, redis_url, "--burst", "--inflight", str(K), *extra,
                         name=f"{run}-w")  # fmt: skip
        wait_until(lambda: info(server)["pending_requests"] >= K, timeout=120, interval=0.05)
    finally:
        httpx.post(server.url + "/admin/resume", timeout=10).raise_for_status()
    assert w.proc.wait(300) == 0, w.log_tail()
    return w


RID = re.compile(r"hsq-(?P<sid>[A-Za-z0-9._-]+)-a\d+-[0-9a-f]{8}")


def mixed_samples(server: ReferenceServer, run: str) -> set[str]:
    """Samples of `run` whose dump got another request's states (the server's own log)."""
    found = set()
    for e in log_events(server.log_path, "fault_mix"):
        m = RID.fullmatch(str(e["rid"]))
        if m and m["sid"].startswith(run):
            found.add(m["sid"])
    return found


def dataset(tmp: Path, run: str, seed: int) -> Path:
    ds = tmp / f"{run}.jsonl"
    # One length for every sample: mixed states then fit every check the worker makes.
    write_synthetic(ds, N, seed=seed, min_len=16, max_len=16)
    ids = [f"{run}{i:03d}" for i in range(N)]
    rows = [json.loads(x) for x in ds.read_text().splitlines()]
    ds.write_text(
        "".join(json.dumps({**r, "id": i}) + "\n" for r, i in zip(rows, ids, strict=True))
    )
    return ds


def audit(run: str, server: ReferenceServer, redis_url: str, *extra: str,
          progress: bool = False) -> tuple[int, str]:  # fmt: skip
    res = hsq("audit", "--run", run, "--redis", redis_url, "--sample-fraction", "1",
              "--server", server.url, "--dump-dir", str(server.dump_dir),
              *([] if progress else ["--no-progress"]), *extra)  # fmt: skip
    return res.returncode, res.stdout + res.stderr


def mismatches(text: str) -> set[str]:
    return {ln.split()[1].rstrip(":") for ln in text.splitlines() if ln.startswith("  mismatch")}
