"""`make compose-test`: docker-compose.yml started for real, with images built here.

No image registry is reachable from our machines, so every image comes from Debian packages
(scripts/docker_local_images.sh: a debootstrap base, cached between runs, then python+torch,
redis and prometheus) and docker-compose.local.yml swaps them in with host networking; the
daemon, when this test starts it, runs with --bridge=none. The cpu profile runs a small run
end to end through `make compose-demo`'s script; every output verifies; Prometheus scraped
the worker and the exporter; `down` leaves no container. The gpu profile cannot run here
(no GPU, and its SGLang base image cannot be pulled): `config` validates it, and
Dockerfile.sglang's own steps run on a stand-in base (the pinned SGLang wheel, with no
CUDA, in hsq's image) to prove the hook's entry point is found in the image it builds.
Needs root, docker.io, docker-compose and debootstrap (scripts/setup_deploy.sh).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_helpers import (
    ROOT,
    port_free,
    prometheus_targets,
    prometheus_value,
    require,
    sh,
    wait_for,
)

import hsq
from hsq.node.procs import ManagedProcess

SAMPLES = 48
# What the cpu profile listens on with host networking (docker-compose.yml).
PORTS = {"redis": 6379, "exporter": 9640, "prometheus": 9090, "reference-0": 30010,
         "cpu-worker-0": 9410}  # fmt: skip
SERVICES = list(PORTS)  # grafana has no local image; the gpu profile cannot run here
PROM = "http://127.0.0.1:9090"


@dataclass
class Stack:
    project: str
    env: dict[str, str]

    @property
    def compose(self) -> list[str]:
        return ["docker-compose", "-p", self.project, "-f", "docker-compose.yml",
                "-f", "docker-compose.local.yml"]  # fmt: skip

    def __call__(self, *args: str, timeout: float = 300) -> str:
        return sh(*self.compose, *args, env=self.env, timeout=timeout)


def docker_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A Docker daemon: the running one, or one started here (no bridge) and stopped after."""
    require("docker", "dockerd", "docker-compose", "debootstrap")
    daemon = None
    if not docker_up():
        log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
        daemon = ManagedProcess(["dockerd", "--bridge=none", "--iptables=false"], log)
        wait_for("dockerd answering", docker_up, 120)
    try:
        yield
    finally:
        if daemon is not None:
            daemon.stop(timeout=60)


@pytest.fixture(scope="module")
def images(docker: None) -> None:  # noqa: ARG001 (docker: a fixture, for its daemon)
    """Local images (cached) and hsq's two images (base, reference) through compose's own
    build sections, which install the wheel in dist/ (`make compose-test` runs `make dist`
    first)."""
    wheels = sorted((ROOT / "dist").glob(f"hidden_state_queue-{hsq.__version__}-*.whl"))
    if len(wheels) != 1:
        pytest.fail(f"dist/ needs one hidden_state_queue {hsq.__version__} wheel: `make dist`")
    t0 = time.monotonic()
    sh(str(ROOT / "scripts/docker_local_images.sh"), timeout=1800,
       env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    t1 = time.monotonic()
    env = {**os.environ, "REDIS_PASSWORD": "unused"}
    sh("docker-compose", "-f", "docker-compose.yml", "-f", "docker-compose.local.yml",
       "build", "exporter", "reference-0", env=env, timeout=1800)  # fmt: skip
    print(f"local base images {t1 - t0:.0f}s, hsq image {time.monotonic() - t1:.0f}s")


@pytest.fixture
def stack(images: None, tmp_path: Path) -> Iterator[Stack]:  # noqa: ARG001 (built first)
    busy = {n: p for n, p in PORTS.items() if not port_free(p)}
    if busy:
        pytest.fail(f"ports the stack listens on are in use: {busy}")
    project = f"hsqtest{os.getpid()}"
    env = {**os.environ, "REDIS_PASSWORD": secrets.token_hex(12), "HSQ_BIND": "127.0.0.1",
           "HSQ_RUN": f"compose-{os.getpid()}", "DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    st = Stack(project, env)
    try:
        yield st
    finally:
        print(subprocess.run([*st.compose, "logs", "--tail", "20"], env=env, cwd=ROOT,
                             capture_output=True, text=True).stdout)  # fmt: skip
        subprocess.run([*st.compose, "--profile", "cpu", "--profile", "tools", "down", "-v"],
                       env=env, cwd=ROOT, capture_output=True, check=False)  # fmt: skip


def test_gpu_and_cpu_profiles_validate() -> None:
    """The compose 1.29 this host has reads both profiles, with the default port file."""
    require("docker-compose")
    env = {**os.environ, "REDIS_PASSWORD": "x"}
    for profile in ("gpu", "cpu"):
        sh("docker-compose", "--profile", profile, "config", "-q", env=env)
    services = sh("docker-compose", "--profile", "gpu", "config", "--services", env=env).split()
    assert {"node", "redis", "grafana"} <= set(services)
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        for profile in ("gpu", "cpu"):
            sh("docker", "compose", "--profile", profile, "config", "-q", env=env)


@pytest.mark.timeout(1800)
def test_cpu_profile_runs_a_run_end_to_end(stack: Stack) -> None:
    stack("--profile", "cpu", "up", "-d", "--no-build", *SERVICES)
    out = sh(str(ROOT / "scripts/compose_demo.sh"), timeout=900,
             env={**stack.env, "COMPOSE": " ".join(stack.compose),
                  "DEMO_SAMPLES": str(SAMPLES)})  # fmt: skip
    run = stack.env["HSQ_RUN"]
    assert f"{SAMPLES}/{SAMPLES} done" in out, out
    verified = stack("run", "--rm", "hsq", "hsq", "verify", "--run", run, "--deep",
                     "--no-progress")  # fmt: skip
    assert f"ok {SAMPLES}, missing 0, corrupt 0" in verified, verified

    def up(job: str, instance: str) -> bool:
        return any(
            t["labels"]["instance"] == instance and t["health"] == "up"
            for t in prometheus_targets(PROM, job)
        )

    wait_for("Prometheus scraping the worker", lambda: up("hsq-worker", "cpu-worker-0:9410"), 120)
    wait_for("Prometheus scraping the exporter", lambda: up("hsq-exporter", "exporter:9640"), 120)
    by_worker = f'sum(hsq_worker_samples_total{{run="{run}",outcome="done"}})'
    by_exporter = f'hsq_run_samples{{run="{run}",state="done"}}'
    for what, q in (("the worker's", by_worker), ("the exporter's", by_exporter)):
        wait_for(f"{what} count", lambda q=q: prometheus_value(PROM, q) == SAMPLES, 90)

    stack("--profile", "cpu", "--profile", "tools", "down", "-v")
    left = sh("docker", "ps", "-a", "-q", "--filter",
              f"label=com.docker.compose.project={stack.project}")  # fmt: skip
    assert left.strip() == "", f"containers left after down: {left}"


def pinned_sglang_version() -> str:
    m = re.search(r"^ARG SGLANG_IMAGE=\S+:v?(\S+)$", (ROOT / "Dockerfile.sglang").read_text(), re.M)
    assert m, "Dockerfile.sglang has no ARG SGLANG_IMAGE=...:vX.Y.Z"
    return m.group(1)


@pytest.mark.timeout(1800)
@pytest.mark.usefixtures("images")
def test_gpu_server_image_steps_find_the_hook(tmp_path: Path) -> None:
    """Dockerfile.sglang on a stand-in for the SGLang image (which cannot be pulled here):
    hsq's image with hsq removed and the pinned SGLang wheel added without its CUDA deps."""
    version = pinned_sglang_version()
    wheels = sorted((ROOT / ".cache/sglang").glob(f"sglang-{version}-*.whl"))
    if not wheels:
        pytest.fail(f"no sglang {version} wheel in .cache/sglang: scripts/fetch_sglang_sources.sh")
    shutil.copy(wheels[0], tmp_path)
    (tmp_path / "Dockerfile").write_text(
        "FROM hsq-reference:latest\n"  # SGLang's image has torch; hsq:latest has not
        "RUN pip uninstall -q -y hidden-state-queue\n"
        "COPY *.whl /tmp/\n"
        "RUN pip install -q --no-deps /tmp/*.whl && rm /tmp/*.whl\n"
    )
    standin, image = f"hsq-test/sglang-standin:{version}", "hsq-test/sglang-server:standin"
    sh("docker", "build", "--network", "host", "-q", "-t", standin, str(tmp_path), timeout=900)
    try:
        # The build runs check_hook.py itself and fails if the entry point is not found.
        sh("docker", "build", "--network", "host", "-q", "-f", "Dockerfile.sglang",
           "--build-arg", f"SGLANG_IMAGE={standin}", "-t", image, ".", timeout=900)  # fmt: skip
        out = sh("docker", "run", "--rm", "--network", "host", image,
                 "python3", "/opt/hsq/check_hook.py")  # fmt: skip
        assert f"sglang {version}, hsq_dump -> hsq.engines.sglang.plugin:register" in out
        # hsq in the image is the wheel's, installed in site-packages: no source tree.
        where = sh("docker", "run", "--rm", "--network", "host", image, "python3", "-c",
                   "import hsq, importlib.metadata as m; "
                   "print(hsq.__file__, m.version('hidden-state-queue'))")  # fmt: skip
        assert f"site-packages/hsq/__init__.py {hsq.__version__}" in where, where
        cmd = sh("docker", "run", "--rm", "--network", "host", image, "hsq", "launch-sglang",
                 "--model-path", "/m", "--dump-dir", "/dumps", "--print-only")  # fmt: skip
        assert "--disable-radix-cache" in cmd and "sglang.launch_server" in cmd, cmd
    finally:
        subprocess.run(["docker", "rmi", "-f", image, standin], capture_output=True, check=False)
