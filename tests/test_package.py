"""The artifact people install: the sdist and the wheel `make dist` builds, checked,
then the wheel installed into a fresh virtual environment with no source tree and run there.

The fresh venv takes torch, and what torch needs, from this interpreter through a .pth file
of links: a CPU host's torch is a local wheel but a GPU host's is a CUDA build of several GB,
and what is under test is hsq's wheel. Everything else the wheel requires pip resolves and
installs in the fresh venv, with constraints.txt (the versions CI uses).

About a minute; `-m "not package"` leaves it out of a quick local run (CI runs it).
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import hsq
from hsq.engines.sglang.compat import ENTRY_POINT_GROUP, ENTRY_POINT_NAME, ENTRY_POINT_VALUE
from tests.slim import Slim, base_roles, site_packages
from tests.support.procs import ReferenceServer

pytestmark = [pytest.mark.package, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
DIST_NAME = "hidden-state-queue"
# What installs: the package as the tree has it (real directories, no links: a
# zip download and a core.symlinks=false clone lost the linked ones).
SOURCE_DIRS = {"hsq": "hsq"}
GENERIC = ("workers", "producer", "sglang_server")


def installed_paths() -> set[str]:
    """Every file the wheel must hold under hsq/, as the source tree has it."""
    want = {"hsq/py.typed"}
    for src, dest in SOURCE_DIRS.items():
        for dirpath, dirnames, filenames in os.walk(ROOT / src):  # links are not followed
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = Path(dirpath).relative_to(ROOT / src)
            want |= {(Path(dest) / rel / f).as_posix() for f in filenames if f.endswith(".py")}
    return want


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path
    log: str


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """`make dist`'s build: the sdist, then the wheel built from the unpacked sdist."""
    out = tmp_path_factory.mktemp("dist")
    proc = run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], timeout=600)
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == len(wheels) == 1, proc.stdout
    return Dist(sdists[0], wheels[0], proc.stdout + proc.stderr)


def run(
    argv: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_the_sdist_and_wheel_pass_twine_check(dist: Dist) -> None:
    run([sys.executable, "-m", "twine", "check", "--strict", str(dist.sdist), str(dist.wheel)])
    assert "* Building wheel from sdist" in dist.log, dist.log  # the sdist is complete


def test_the_sdist_holds_the_service_directories_as_real_files(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as tar:
        members = tar.getmembers()
    prefix = f"hidden_state_queue-{hsq.__version__}/"
    assert all(f"{m.name}/".startswith(prefix) for m in members)
    links = [m.name for m in members if m.issym() or m.islnk()]
    assert links == [], f"links in the sdist (an unpacked copy would point nowhere): {links}"
    files = {m.name.removeprefix(prefix) for m in members if m.isfile()}
    assert {p for p in files if p.startswith("hsq/")} == installed_paths()
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"} <= files
    assert not any(p.startswith("tests/") for p in files), "tests need the repository"


def test_the_wheel_installs_one_top_level_name_and_says_what_it_is(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as whl:
        names = whl.namelist()
        info = f"hidden_state_queue-{hsq.__version__}.dist-info"
        top_level = whl.read(f"{info}/top_level.txt").decode().split()
        meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    assert top_level == ["hsq"]
    assert {n.split("/")[0] for n in names} == {"hsq", info}
    assert {n for n in names if n.startswith("hsq/")} == installed_paths()
    assert f"{info}/licenses/LICENSE" in names
    assert meta["Name"] == DIST_NAME and meta["Version"] == hsq.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.11"
    assert f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_NAME} = {ENTRY_POINT_VALUE}" in entry_points
    assert "hsq = hsq.cli.main:main" in entry_points


def head_package_files() -> set[str]:
    """The .py files under hsq/ in the committed tree (what an archive of HEAD holds)."""
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD", "hsq"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    files = {p for p in listed if p.endswith(".py")} | {"hsq/py.typed"}
    # The modules the old links hid: the services and the entry point SGLang loads.
    hook = ENTRY_POINT_VALUE.split(":")[0].replace(".", "/") + ".py"
    assert {hook, "hsq/workers/worker.py", "hsq/producer/enqueue.py"} <= files
    return files


def wheel_files(src: Path, out: Path) -> set[str]:
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(out), str(src)], timeout=600)  # fmt: skip
    (whl,) = out.glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        return {n for n in z.namelist() if n.startswith("hsq/")}


def test_a_wheel_from_a_zip_download_is_complete(tmp_path: Path) -> None:
    """GitHub's "Download ZIP" is `git archive --format=zip`; links used to vanish."""
    archive = tmp_path / "src.zip"
    run(["git", "archive", "--format=zip", "-o", str(archive), "HEAD"], cwd=ROOT)
    with zipfile.ZipFile(archive) as z:
        z.extractall(tmp_path / "src")
    assert wheel_files(tmp_path / "src", tmp_path / "whl") == head_package_files()


def test_a_wheel_from_a_clone_without_symlinks_is_complete(tmp_path: Path) -> None:
    """Git for Windows' default, core.symlinks=false."""
    run(["git", "-c", "core.symlinks=false", "clone", "-q", str(ROOT), str(tmp_path / "src")])
    assert wheel_files(tmp_path / "src", tmp_path / "whl") == head_package_files()


def test_the_python_floor_is_the_interpreter_ci_runs() -> None:
    """requires-python's floor is tested: CI's Python is that floor (docs/packaging.md)."""
    meta = md.metadata(DIST_NAME)
    floor = re.fullmatch(r">=3\.(\d+)", meta["Requires-Python"])
    assert floor is not None
    if os.environ.get("CI"):
        assert sys.version_info[:2] == (3, int(floor.group(1)))


# --- the wheel in a fresh venv --------------------------------------------------------------


@dataclass(frozen=True)
class Venv:
    path: Path
    work: Path  # the cwd for every command: no source tree, nothing of the repository
    env: dict[str, str]

    @property
    def python(self) -> str:
        return str(self.path / "bin/python")

    def __call__(self, *argv: str, timeout: float = 300) -> str:
        return run(list(argv), cwd=self.work, env=self.env, timeout=timeout).stdout

    def probe(self, code: str) -> object:
        """Run CODE in the venv's Python; it prints one JSON value."""
        return json.loads(self(self.python, "-c", textwrap.dedent(code)))


def closure(name: str, seen: dict[str, md.Distribution]) -> None:
    """`name` and what it requires (markers evaluated here), as installed distributions."""
    from packaging.requirements import Requirement

    dist = md.distribution(name)
    if dist.metadata["Name"].lower() in seen:
        return
    seen[dist.metadata["Name"].lower()] = dist
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            closure(req.name, seen)


def share_torch(site_packages: Path, links: Path) -> list[str]:
    """Links to this interpreter's torch and its requirements, on the venv's path (.pth)."""
    seen: dict[str, md.Distribution] = {}
    closure("torch", seen)
    links.mkdir()
    for dist in seen.values():
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (base / top).exists() and not (links / top).exists():
                (links / top).symlink_to(base / top)
    (site_packages / "_shared_torch.pth").write_text(f"{links}\n")
    return sorted(seen)


@pytest.fixture(scope="module")
def venv(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    base = tmp_path_factory.mktemp("fresh")
    path, work = base / "venv", base / "work"
    work.mkdir()
    # No source tree on the path: no PYTHONPATH, no other venv, cwd outside the repository.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}  # fmt: skip
    env["PATH"] = f"{path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["TMPDIR"] = str(work)  # the demo's log directory stays in pytest's temp
    v = Venv(path, work, env)
    run([sys.executable, "-m", "venv", str(path)])
    site = path / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    share_torch(site, base / "shared-torch")
    # [reference]: the demo runs the reference server (transformers; torch is shared in).
    v(v.python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
      "-c", str(ROOT / "constraints.txt"), f"{dist.wheel}[reference]", timeout=600)  # fmt: skip
    yield v


def test_the_installed_command_prints_the_version(venv: Venv) -> None:
    out = venv(str(venv.path / "bin/hsq"), "--version")
    assert out.strip() == f"hsq, version {hsq.__version__}"
    version = f"import json, importlib.metadata as m; print(json.dumps(m.version({DIST_NAME!r})))"
    assert venv.probe(version) == hsq.__version__
    assert venv(venv.python, "-m", "hsq", "--version").strip() == out.strip()


def test_the_installed_package_is_the_only_top_level_name_it_adds(venv: Venv) -> None:
    found = venv.probe(f"""
        import importlib.metadata as md, importlib.util, json, hsq, hsq.workers.worker
        import hsq.producer.enqueue, hsq.engines.reference.app
        dist = md.distribution({DIST_NAME!r})
        tops = {{str(f).split("/")[0] for f in dist.files}} - {{".."}}
        print(json.dumps({{
            "tops": sorted(t for t in tops if not t.endswith(".dist-info")),
            "generic": [n for n in {list(GENERIC)!r} if importlib.util.find_spec(n)],
            "files": [m.__file__ for m in (hsq, hsq.workers.worker, hsq.producer.enqueue,
                                           hsq.engines.reference.app)],
            "site": str(dist.locate_file("")),
        }}))
    """)
    assert isinstance(found, dict)
    assert found["tops"] == ["hsq"]
    assert found["generic"] == [], "a generic top-level module is importable"
    site = Path(found["site"])
    assert site.is_relative_to(venv.path)
    for f in found["files"]:
        assert Path(f).is_relative_to(site / "hsq") and not Path(f).is_symlink(), f
    # Nothing else in site-packages carries a generic name either.
    assert not [n for n in GENERIC if (site / n).exists() or (site / f"{n}.py").exists()]


def test_sglangs_plugin_loader_finds_and_loads_the_hook(venv: Venv) -> None:
    """What SGLang's load_plugins() does: the group's entry points, each loaded."""
    found = venv.probe(f"""
        import importlib.metadata as md, json
        eps = [e for e in md.entry_points(group={ENTRY_POINT_GROUP!r})]
        register = eps[0].load()
        print(json.dumps({{"eps": [[e.name, e.value, e.dist.name] for e in eps],
                           "register": [register.__module__, register.__name__,
                                        callable(register)]}}))
    """)
    assert found == {
        "eps": [[ENTRY_POINT_NAME, ENTRY_POINT_VALUE, DIST_NAME]],
        "register": ["hsq.engines.sglang.plugin", "register", True],
    }


def test_a_small_demo_runs_from_the_installed_wheel(venv: Venv) -> None:
    """Private redis-server, reference server, producer and worker: all from the venv."""
    out = venv(str(venv.path / "bin/hsq"), "--log-format", "json", "demo", "--samples", "8",
               "--out", str(venv.work / "out"), timeout=600)  # fmt: skip
    assert "8/8 done, 0 dead" in out and "verified      8/8 outputs OK" in out, out
    assert "demo OK" in out


# --- the base install: the wheel without extras, no torch ------------------


def test_the_wheel_without_extras_runs_the_base_roles_without_torch(
    dist: Dist, tmp_path: Path, redis_url: str
) -> None:
    """pip resolves the wheel's base requirements alone into a fresh venv (no torch shared
    in): enqueue, a worker against a reference server of this install over HTTP, status,
    verify --deep, recover and the exporter all run there (tests/slim.py)."""
    path, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    run([sys.executable, "-m", "venv", str(path)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [str(path / "bin/python"), "-m", "pip", "--disable-pip-version-check"]
    constraints = ["-c", str(ROOT / "constraints.txt")]
    run([*pip, "install", "-q", *constraints, str(dist.wheel)], cwd=work, env=env, timeout=600)
    run([*pip, "check"], cwd=work, env=env)
    size = run(["du", "-sh", str(site_packages(path))]).stdout.split()[0]
    print(f"base install: site-packages {size}")

    def start(dumps: Path) -> ReferenceServer:  # from this, the full, install
        return ReferenceServer(dumps, work / "server.log", args=["--threads", "2"]).wait_ready()

    base_roles(Slim(path / "bin/python", work, redis_url), start)
