from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning (libgomp reads this when torch loads it:
# before any import of torch). With two torch threads per server on a shared 2-core
# machine, spinning cost ~9x the CPU of each tiny forward (docs/reference-server.md).
# Set for the test process and everything it starts, the zygote and its servers included;
# the computation, so every state, is the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hsq.dump.format import fingerprint
from hsq.dump.read import Expected
from hsq.node.procs import RedisServer
from hsq.node.spawn import FRESH, Spawner
from hsq.stfile.engine import WriteEngine
from tests.support.netns import netns  # noqa: F401  (the fixture, for the tests of hosts)
from tests.support.procs import ReferenceServer
from tests.support.spawner import SPAWNER_ENV, ZygoteSpawner, install
from tests.support.trainers import no_trainer_left  # noqa: F401  (the fixture)

# The repository root first on every child's path: tests/support's servers and the zygote
# start as `python -m tests.support.X`, and some tests start them from another directory.
ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
)

# SpecForge's and speculators' code, which the tests compare hsq with, is in .trainers/ (no
# dependencies: their pins conflict with hsq's, scripts/setup.sh says why), not in .venv.
# Appended: nothing there may shadow a package of the venv. Subprocesses see it too.
TRAINERS = Path(__file__).resolve().parents[1] / ".trainers"
if TRAINERS.is_dir() and str(TRAINERS) not in sys.path:
    sys.path.append(str(TRAINERS))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(TRAINERS)) if p
    )


def expected_for(ids: list[int], rid: str, **kw: object) -> Expected:
    return Expected(rid=rid, input_fingerprint=fingerprint(ids), num_tokens=len(ids), **kw)  # type: ignore[arg-type]


def generate(url: str, ids: list[int], rid: str, timeout: float = 30.0) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "rid": rid}
    return httpx.post(url + "/generate", json=body, timeout=timeout)


@pytest.fixture(scope="session", autouse=True)
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawner]:
    """One zygote per test session (per xdist worker), started at the first fork: each
    dump server, each worker of tests/helpers.py and each of its `hsq_process()` commands is a
    fork of a process that has imported torch, transformers and hsq (seconds of CPU a
    start), not a fresh interpreter. HSQ_TEST_SPAWNER=fresh: no zygote."""
    if os.environ.get(SPAWNER_ENV, "zygote") == "fresh":
        yield FRESH
        return
    z = ZygoteSpawner(tmp_path_factory.mktemp("zygote") / "zygote.log")
    previous = install(z)
    yield z
    install(previous)
    z.close()


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Start reference servers as real processes (forks of the session's zygote unless
    `spawner=FRESH`); all are stopped when the test file ends (a server holds about
    450 MB: a session's worth would pile up in each xdist worker)."""
    started: list[ReferenceServer] = []

    def start(*args: str, name: str = "srv", spawner: Spawner | None = None) -> ReferenceServer:
        base = tmp_path_factory.mktemp(name)
        srv = ReferenceServer(
            base / "dumps", base / "server.log", args=["--threads", "2", *args], spawner=spawner
        )
        started.append(srv)
        return srv

    yield start
    for srv in started:  # all at once, then wait for each: they shut down side by side
        srv.signal(signal.SIGTERM)
    for srv in started:
        srv.stop()


@pytest.fixture
def engine() -> Iterator[WriteEngine]:
    """A write engine as the worker's persist stage owns one, closed after the test."""
    with WriteEngine() as e:
        yield e


@pytest.fixture
def dump_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dumps"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server with a password, as in production; one per test session."""
    srv = RedisServer(tmp_path_factory.mktemp("redis"), password="test-secret").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url
