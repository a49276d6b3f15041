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

from hsq.engines.sglang.compat import PINNED_VERSIONS, parse_version, plugin_supported

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
    # Redis requires its password, read from the environment into a config file (never
    # on a command line, where every local user reads it).
    redis_cmd = " ".join(services["redis"]["command"])
    assert "requirepass" in redis_cmd and "$$REDIS_PASSWORD" in redis_cmd
    assert services["redis"]["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    for ports in (s["ports"] for s in compose("docker-compose.override.yml")["services"].values()):
        assert all(p.startswith("${HSQ_PUBLISH_HOST:-127.0.0.1}:") for p in ports), ports


def test_every_compose_worker_waits_for_a_healthy_server_it_shares_a_dump_dir_with() -> None:
    services = compose("docker-compose.yml")["services"]
    workers = {n: s for n, s in services.items() if s.get("command", [None, None])[1] == "worker"}
    assert {"cpu-worker-0"} <= set(workers)
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
    # The gpu profile is one `hsq run --join`: it starts its servers and workers itself.
    node = services["node"]["command"]
    assert node[:4] == ["hsq", "run", "--join", "--stay"] and "--metrics-host" in node
    assert node[node.index("--engine") + 1] == "sglang"


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


def test_worker_node_is_hsq_run_join_and_binds_metrics_explicitly() -> None:
    text = (SLURM / "worker-node.sbatch").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "sglang.launch_server" not in code and "launch-sglang" not in code
    assert '"$HSQ_VENV/bin/hsq" run --join --stay' in code  # servers and workers: hsq run's
    assert '--redis-url-file "$URL_FILE"' in code
    assert "URL_FILE=${HSQ_REDIS_URL_FILE:-$STATE/redis-url}" in code
    assert "--metrics-host" in code and "HSQ_ENGINE=reference" in text
    # `hsq run` starts SGLang through the launcher (its refusals and readiness checks).
    supervisor = (ROOT / "hsq/node/supervisor.py").read_text()
    assert '"launch-sglang"' in supervisor and "sglang.launch_server" not in supervisor
    assert "redis-url" in code and "WAIT_S" in code
    head = (SLURM / "head.sbatch").read_text()
    assert 'HSQ_REDIS_URL=$HSQ_REDIS_URL "$HSQ_VENV/bin/hsq" exporter --metrics-host' in head


# --------------------------------------------------------------------------- secrets
# Every local user reads any process's command line (`ps`, /proc/PID/cmdline), so a recipe,
# compose file or documented example that puts a password in one gives it away.
RECIPES = [
    *sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file() and p.suffix != ".pyc"),
    *sorted(ROOT.glob("docker-compose*.yml")),
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "scripts").glob("*")),
    ROOT / "README.md",
    ROOT / "Makefile",
    ROOT / "Dockerfile",
    ROOT / "Dockerfile.sglang",
    ROOT / "hsq/cli/main.py",  # the --help examples
]
_URL_WITH_AUTH = re.compile(r"rediss?://[^\s/@`'\"]*:[^\s@`'\"]*@")
_ARG_RULES = [
    # --redis VALUE (not --redis-ca/-cert/-key/-url-file) whose value is a variable or holds auth
    (re.compile(r"--redis(?![-\w])[\"']?(?:\s*,\s*[\"']|=|\s+)[\"']?[$][^\s]*"), "--redis $VAR"),
    (re.compile(r"--redis(?![-\w])[\"']?(?:\s*,\s*[\"']|=|\s+)[\"']?[^\s\"']*@"), "--redis URL@"),
    (re.compile(r"--requirepass"), "redis-server --requirepass"),
    (re.compile(r"redis-cli\b.*\s-a\s"), "redis-cli -a"),
    (re.compile(r"redis-cli\b.*\s-u\s+\S*@"), "redis-cli -u URL@"),
    (re.compile(r"redis-cli\b.*\bAUTH\b|redis-cli\b.*SETUSER.*>"), "redis-cli AUTH/ACL password"),
    (re.compile(r"--pass(word)?[= ]+\S"), "--password VALUE"),
]
# A URL with a password may be assigned to a variable (shell, compose `environment:`) or
# quoted in prose, never passed as an argument.
_ASSIGNED = re.compile(r"(?:[A-Z_][A-Z0-9_]*\s*[=:]\s*[\"']?|`)$")


def password_on_command_line(text: str) -> list[str]:
    found = []
    for no, line in enumerate(text.splitlines(), start=1):
        for rule, what in _ARG_RULES:
            if rule.search(line):
                found.append(f"{no}: {what}: {line.strip()}")
        for m in _URL_WITH_AUTH.finditer(line):
            if not _ASSIGNED.search(line[: m.start()]):
                found.append(f"{no}: URL with a password as an argument: {line.strip()}")
    return found


def test_no_recipe_or_example_puts_a_password_on_a_command_line() -> None:
    problems = []
    for path in RECIPES:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        problems += [f"{path.relative_to(ROOT)}:{p}" for p in password_on_command_line(text)]
    assert problems == []


@pytest.mark.parametrize(
    "line",
    [
        '"$HSQ_VENV/bin/hsq" exporter --redis "$HSQ_REDIS_URL" --metrics-host "$BIND"',
        "hsq enqueue data.jsonl --run r --out /o --redis redis://:PW@head:6379/0",
        'command: ["hsq", "exporter", "--redis", "${REDIS_URL}"]',
        "hsq status --redis=$REDIS_URL",
        'redis-server --port 6379 --requirepass "$PW"',
        'redis-cli -a "$REDIS_PASSWORD" ping',
        "redis-cli -u redis://:pw@head:6379 ping",
        "python -m bench.x redis://:pw@head:6379/0",
    ],
)
def test_the_secret_check_catches_each_form(line: str) -> None:
    assert password_on_command_line(line), line


@pytest.mark.parametrize(
    "line",
    [
        "export HSQ_REDIS_URL=redis://:PW@head:6379/0",
        "  REDIS_URL: redis://:${REDIS_PASSWORD:?set REDIS_PASSWORD}@redis:6379/0",
        'HSQ_REDIS_URL="redis://:$ENC@$HEAD:$REDIS_PORT/0"',
        "connect as `rediss://hsq:<PASSWORD>@head:6380/0`",
        "hsq status --redis redis://127.0.0.1:6379/0 --redis-url-file /run/secrets/r",
        'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli ping',
    ],
)
def test_the_secret_check_allows_the_environment_and_files(line: str) -> None:
    assert password_on_command_line(line) == [], line


# --- images install the built wheel ----------------------------------------------

WHEEL = "dist/hidden_state_queue-0.2.0-py3-none-any.whl"  # a name `make dist` could write


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or a parent of it decides."""

    def match(pattern: str, name: str) -> bool:
        rx = re.escape(pattern.strip("/")).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        return re.fullmatch(rx.replace(r"\?", "[^/]"), name) is not None

    parts = path.split("/")
    excluded = False
    for raw in patterns:
        keep = raw.startswith("!")
        pattern = raw.removeprefix("!")
        if any(match(pattern, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not keep
    return excluded


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def test_the_image_build_context_is_the_wheel_and_no_source_tree() -> None:
    patterns = dockerignore()
    for kept in (WHEEL, "constraints.txt", "deploy/docker/check_hook.py"):
        assert not dockerignore_excludes(kept, patterns), kept
    left = ["hsq/store.py", "workers/worker.py", "producer/enqueue.py", "pyproject.toml",
            "sglang_server/reference/app.py", "dist/hidden_state_queue-0.2.0.tar.gz",
            ".venv/bin/python", ".git/HEAD", "data/train.jsonl", "tests/test_x.py"]  # fmt: skip
    assert [p for p in left if not dockerignore_excludes(p, patterns)] == []


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.sglang"])
def test_images_install_the_built_wheel(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    patterns = dockerignore()
    copies = re.findall(r"^COPY\s+(.+)$", text, re.M)
    assert copies
    for line in copies:
        for src in line.split()[:-1]:  # every source is in the build context
            sample = WHEEL if src == "dist/hidden_state_queue-*.whl" else src
            assert not dockerignore_excludes(sample, patterns), f"{dockerfile}: COPY {src}"
    assert "COPY dist/hidden_state_queue-*.whl /tmp/hsq/" in text
    installs = re.findall(r"pip install.*", text.replace("\\\n", " "))  # continued lines joined
    wheel_installs = [i for i in installs if "/tmp/hsq/hidden_state_queue-*.whl" in i]
    # One install of the wheel per image target (Dockerfile: base, and reference on top).
    stages = re.split(r"^FROM\s", text, flags=re.M)[1:]
    assert len(wheel_installs) == len(stages), installs
    assert not [i for i in installs if re.search(r"\s(\.|-e)(\s|$)", i)], "the source tree"


def test_the_make_targets_that_build_images_build_the_wheel_first() -> None:
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^compose-test:.*\bdist\b", make, re.M)
    assert re.search(r"^dist:\n\trm -rf dist\n\t\$\(PY\) -m build", make, re.M)


def test_install_lines_name_the_distribution() -> None:
    """`pip install hsq` would install an unrelated 2016 project; an editable source install
    is for developers (`make setup`), not for SGLang's environment."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "deploy").rglob("*.sbatch")), *sorted((ROOT / "deploy").rglob("*.md")),
             ROOT / "Dockerfile", ROOT / "Dockerfile.sglang"]  # fmt: skip
    bad = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"pip install\b.*(\bhsq(\s|$|\[)|-e\s+\S*hsq)", line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert bad == []


def test_setup_installs_numpy_before_it_imports_torch() -> None:
    """torch does not depend on NumPy and warns `Failed to initialize NumPy` at each import
    without it: setup's torch checks printed it twice on a fresh venv."""
    lines = (ROOT / "scripts/setup.sh").read_text().splitlines()
    code = [ln for ln in lines if not ln.lstrip().startswith("#")]
    first_torch = next(i for i, ln in enumerate(code) if "import torch" in ln and ".venv" in ln)
    numpy = next(i for i, ln in enumerate(code) if "install" in ln and " numpy" in ln)
    assert numpy < first_torch and "-c constraints.txt" in code[numpy], code[numpy]
