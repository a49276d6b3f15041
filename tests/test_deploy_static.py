"""Deployment files read as a user would, without starting them (make compose-test and
make slurm-test start them: deploy/tests/). Cheap enough for every `make test`."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsq.sglang_server.sglang_hook.compat import PINNED_VERSIONS, parse_version, plugin_supported

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "deploy/slurm"


def compose(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / name).read_text())
    return data


def test_gpu_image_is_pinned_in_one_place_to_a_version_the_hook_conforms_to() -> None:
    text = (ROOT / "Dockerfile.sglang").read_text()
    pins = re.findall(r"^ARG SGLANG_IMAGE=(\S+)$", text, re.M)
    assert len(pins) == 1, pins
    image, _, tag = pins[0].partition(":")
    assert image == "lmsysorg/sglang"
    version = tag.removeprefix("v")
    assert version in PINNED_VERSIONS and plugin_supported(version), version
    assert parse_version(version) == max(parse_version(v) for v in PINNED_VERSIONS)
    assert "FROM ${SGLANG_IMAGE}" in text and "check_hook.py" in text
    # Nowhere else: compose builds the image from the Dockerfile, never names the tag.
    for other in ("docker-compose.yml", "docker-compose.local.yml", "Makefile"):
        assert "lmsysorg/sglang" not in (ROOT / other).read_text(), other


def test_compose_is_readable_by_compose_1_29_and_safe_by_default() -> None:
    base = compose("docker-compose.yml")
    assert "name" not in base  # docker-compose 1.29 refuses a top-level name
    services = base["services"]
    for name, svc in services.items():
        image = svc.get("image", "")
        assert not image.endswith(":latest") or "build" in svc, f"{name}: unpinned {image}"
        assert "ports" not in svc, f"{name}: ports belong in docker-compose.override.yml"
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    for ports in (s["ports"] for s in compose("docker-compose.override.yml")["services"].values()):
        assert all(p.startswith("${HSQ_PUBLISH_HOST:-127.0.0.1}:") for p in ports), ports


def test_every_compose_worker_waits_for_a_healthy_server_it_shares_a_dump_dir_with() -> None:
    services = compose("docker-compose.yml")["services"]
    workers = {n: s for n, s in services.items() if s.get("command", [None, None])[1] == "worker"}
    assert {"worker-0", "worker-1", "cpu-worker-0"} <= set(workers)
    for name, svc in workers.items():
        cmd = svc["command"]
        server = cmd[cmd.index("--server") + 1].removeprefix("http://").split(":")[0]
        assert svc["depends_on"][server] == {"condition": "service_healthy"}, name
        assert svc["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        assert "healthcheck" in services[server], server
        assert svc["profiles"] == services[server]["profiles"], name
        assert "--metrics-host" in cmd, f"{name}: the metrics bind must be explicit"
        dump = cmd[cmd.index("--dump-dir") + 1]
        mine = {v.split(":")[0] for v in svc["volumes"] if v.split(":")[1] == dump}
        assert mine and mine <= {v.split(":")[0] for v in services[server]["volumes"]}, name
        # A tmpfs root is 1777 by default: the worker refuses a sticky (shared) dump dir.
        volumes = compose("docker-compose.yml")["volumes"]
        for vol in mine:
            assert "mode=0700" in volumes[vol]["driver_opts"]["o"], vol
    assert services["sglang-0"]["command"][:2] == ["hsq", "launch-sglang"]


def test_local_override_uses_host_networking_for_what_it_starts() -> None:
    local = compose("docker-compose.local.yml")["services"]
    base = compose("docker-compose.yml")["services"]
    cpu = {n for n, s in base.items() if "cpu" in s.get("profiles", [])}
    assert cpu <= set(local)
    reached = set(base) - {"hsq"}  # every service another one (or Prometheus) connects to
    for name, svc in local.items():
        assert svc["network_mode"] == "host", name
        assert {h.split(":")[0] for h in svc["extra_hosts"]} == reached, name
        assert all(h.endswith(":127.0.0.1") for h in svc["extra_hosts"]), name


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose here")
@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_config_validates(profile: str) -> None:
    p = subprocess.run(
        ["docker-compose", "--profile", profile, "config", "-q"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", "REDIS_PASSWORD": "x"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("script", ["head.sbatch", "worker-node.sbatch"])
def test_sbatch_recipes_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True)


def test_worker_node_starts_sglang_through_the_launcher_and_binds_metrics_explicitly() -> None:
    text = (SLURM / "worker-node.sbatch").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "sglang.launch_server" not in code
    assert '"$HSQ_VENV/bin/hsq" launch-sglang' in code
    assert "--metrics-host" in code and "HSQ_SERVER=reference" in text
    assert "redis-url" in code and "WAIT_S" in code
    head = (SLURM / "head.sbatch").read_text()
    assert 'exporter --redis "$HSQ_REDIS_URL" --metrics-host' in head
