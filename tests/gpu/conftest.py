"""Every test here needs CUDA and an installed SGLang: without them each is skipped with
the reason (never passed). `make test` deselects the `gpu` marker altogether."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsq.node.procs import RedisServer
from tests.gpu.results import Results
from tests.gpu.settings import LiveSettings

HERE = Path(__file__).parent


def _missing(engine: str = "sglang") -> str | None:
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (scripts/vllm_live.sh runs the same checks from its bundle)"
    if engine == "sglang" and importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (run through scripts/sglang_live.sh on a GPU machine)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(
    config: pytest.Config,  # noqa: ARG001 (pytest passes it by name)
    items: list[pytest.Item],
) -> None:
    mine = [i for i in items if Path(str(i.fspath)).is_relative_to(HERE)]
    reasons: dict[str, str | None] = {}
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        # test_vllm_*.py need vLLM; every other test here serves with SGLang.
        engine = "vllm" if Path(str(item.fspath)).name.startswith("test_vllm") else "sglang"
        if engine not in reasons:
            reasons[engine] = _missing(engine)
        reason = reasons[engine]
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def live() -> LiveSettings:
    s = LiveSettings.from_env()
    if s.sglang_version is not None:
        import sglang  # type: ignore[import-not-found,unused-ignore]

        assert sglang.__version__ == s.sglang_version, (
            f"SGLang {sglang.__version__} installed, {s.sglang_version} asked for"
        )
    return s


@pytest.fixture(scope="session")
def work(live: LiveSettings, tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = live.work or tmp_path_factory.mktemp("live")
    w.mkdir(parents=True, exist_ok=True)
    return w


@pytest.fixture(scope="session")
def models_root(live: LiveSettings, work: Path) -> Path:
    return live.models or work / "models"


@pytest.fixture(scope="session")
def dump_root(live: LiveSettings, work: Path) -> Path:
    if live.dump_root is not None:
        return live.dump_root
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else work / "dumps"


@pytest.fixture(scope="session")
def results(live: LiveSettings) -> Results:
    r = Results(live.results)
    import sglang  # type: ignore[import-not-found,unused-ignore]
    import torch

    r.record("env", sglang=sglang.__version__, torch=torch.__version__, tp=live.tp)
    return r


@pytest.fixture(scope="session")
def redis(work: Path) -> Iterator[RedisServer]:
    srv = RedisServer(work / "redis").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture
def fresh(work: Path, dump_root: Path, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """A work dir and a dump dir of this test's own, empty: a phase never reads another
    phase's (or an earlier run's) outputs or dumps."""
    import shutil

    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    wd, dd = work / name, dump_root / f"hsq-live-{os.getpid()}-{name}"
    for d in (wd, dd):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    dd.chmod(0o700)
    return wd, dd
