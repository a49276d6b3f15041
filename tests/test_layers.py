"""The import rules (docs/architecture.md), checked over the tree's own imports.

    contracts  hsq/*.py                    import only contracts
    services   hsq.workers, hsq.producer,  import contracts and their own package
               hsq.sglang_server
    harness    hsq/harness/                imports contracts, services and itself
    shell      hsq/app/, hsq/__main__.py,  may import everything
               hsq/cli.py (old entry point)

A top-level `workers`, `producer` or `sglang_server` import is always wrong: those names are
not installed (issue 25), only `hsq` is. The repository's top-level workers/, producer/ and
sglang_server/ are deployment units (README, env example) and hold no Python (issue 32).

Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hsq",)
DEPLOYMENT_UNITS = ("workers", "producer", "sglang_server")
SERVICES = ("hsq.workers", "hsq.producer", "hsq.sglang_server", "hsq.vllm_server")


def layer(module: str) -> str:
    """The layer of a first-party module (dotted name); "" for anything else."""
    top = module.split(".")[0]
    if top in ("workers", "producer", "sglang_server"):
        return "uninstalled"  # the bare directory names: never importable once installed
    if module in ("hsq.app", "hsq.__main__", "hsq.cli") or module.startswith("hsq.app."):
        return "shell"  # entry points: `python -m hsq`, and hsq.cli for old console scripts
    if module == "hsq.harness" or module.startswith("hsq.harness."):
        return "harness"
    for service in SERVICES:
        if module == service or module.startswith(service + "."):
            return service
    if top == "hsq":
        return "contracts"
    if top in ("tests", "bench", "deploy"):
        return top
    return ""


ALLOWED: dict[str, set[str]] = {
    "contracts": {"contracts"},
    **{s: {"contracts", s} for s in SERVICES},
    "harness": {"contracts", "harness", *SERVICES},
    "shell": {"contracts", "shell", "harness", *SERVICES},
}


def module_name(path: Path, root: Path) -> str:
    """The installed name: hsq/workers/x.py is hsq.workers.x."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the tree, relative ones resolved."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")
                pkg = pkg if is_package else pkg[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            # `from hsq import stfile` imports hsq.stfile: judge the submodule's layer
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def violations(root: Path) -> list[str]:
    found = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            module = module_name(path, root)
            mine = layer(module)
            tree = ast.parse(path.read_text(), str(path))
            for line, target in imported(tree, module, path.name == "__init__.py"):
                theirs = layer(target)
                if theirs and theirs not in ALLOWED[mine]:
                    rel = path.relative_to(root)
                    found.append(f"{rel}:{line}: {mine} {module} imports {theirs} {target}")
    return found


def test_imports_follow_the_layers() -> None:
    assert violations(ROOT) == []


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("hsq/protocol.py", "from hsq.app.ops import run_status\n"),
        ("hsq/protocol.py", "def f() -> None:\n    import hsq.workers.worker\n"),
        ("hsq/stfile.py", "from hsq.harness import procs\n"),
        ("hsq/workers/worker.py", "from hsq.producer.enqueue import enqueue\n"),
        ("hsq/producer/enqueue.py", "from hsq.app import ops\n"),
        ("hsq/sglang_server/app.py", "from hsq.workers import client\n"),
        ("hsq/harness/procs.py", "from hsq.app.cli import main\n"),
        ("hsq/workers/client.py", "from ..app import cli\n"),
        ("hsq/app/cli.py", "import workers.worker\n"),
        ("hsq/protocol.py", "from .workers import client\n"),
    ],
)
def test_the_check_catches_a_wrong_way_import(tmp_path: Path, path: str, source: str) -> None:
    for pkg in ("hsq", "hsq/workers", "hsq/producer", "hsq/sglang_server"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(source)
    assert len(violations(tmp_path)) == 1, source


def test_the_shell_may_import_everything(tmp_path: Path) -> None:
    (tmp_path / "hsq/app").mkdir(parents=True)
    (tmp_path / "hsq/app/cli.py").write_text(
        "import hsq.workers.worker\nimport hsq.producer.enqueue\nfrom hsq.harness import procs\n"
    )
    assert violations(tmp_path) == []


# Only the store (the package hsq.store) talks to Redis; the harness starts redis-server and
# pings it.
REDIS_IMPORTERS = {"hsq.store", "hsq.harness.procs"}


def package_of(module: str) -> str:
    """hsq.store.queue belongs to hsq.store; any other module stands for itself."""
    return "hsq.store" if module.startswith("hsq.store.") else module


def redis_importers(root: Path) -> set[str]:
    found = set()
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            module = module_name(path, root)
            tree = ast.parse(path.read_text(), str(path))
            for _, target in imported(tree, module, path.name == "__init__.py"):
                if target.split(".")[0] in ("redis", "rq"):
                    found.add(module)
    return found


def test_only_the_store_imports_redis_and_rq() -> None:
    assert {package_of(m) for m in redis_importers(ROOT)} <= REDIS_IMPORTERS
    assert "hsq.store" in {package_of(m) for m in redis_importers(ROOT)}


def test_the_redis_check_sees_a_lazy_import(tmp_path: Path) -> None:
    (tmp_path / "hsq/workers").mkdir(parents=True)
    (tmp_path / "hsq/workers/client.py").write_text("def f() -> None:\n    from rq import Queue\n")
    assert redis_importers(tmp_path) == {"hsq.workers.client"}


# The file formats: what a dump, an output file and its storage encoding look like.
FILE_FORMATS = ("hsq.outputs", "hsq.protocol", "hsq.dump", "hsq.stfile", "hsq.quant")


def first_party_imports(root: Path) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (anywhere in it), for every module."""
    graph: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            module = module_name(path, root)
            tree = ast.parse(path.read_text(), str(path))
            found = graph.setdefault(module, set())
            for _, target in imported(tree, module, path.name == "__init__.py"):
                # `from hsq.store import scripts` names a module or a name in one
                while target and target.split(".")[0] in PACKAGES:
                    if (root / (target.replace(".", "/") + ".py")).exists() or (
                        root / target.replace(".", "/") / "__init__.py"
                    ).exists():
                        found.add(target)
                        break
                    target = target.rpartition(".")[0]
    return graph


def file_formats_reached(root: Path, start: str) -> dict[str, list[str]]:
    """The file-format modules that importing `start` (or any module of that package)
    loads, each with one chain of imports that leads there."""
    graph = first_party_imports(root)
    todo = [[m] for m in graph if m == start or m.startswith(start + ".")]
    seen = {chain[0] for chain in todo}
    found: dict[str, list[str]] = {}
    while todo:
        chain = todo.pop()
        here = chain[-1]
        parts = here.split(".")
        # importing a.b.c runs a/b/__init__ first; not hsq/__init__, which loads the names it
        # lists on first use (PEP 562): `from hsq import X` is an edge of its own
        nexts = set(graph.get(here, set())) | {
            ".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in graph
        }
        for nxt in sorted(nexts):
            if any(nxt == f or nxt.startswith(f + ".") for f in FILE_FORMATS):
                found.setdefault(nxt, [*chain, nxt])
            elif nxt not in seen:
                seen.add(nxt)
                todo.append([*chain, nxt])
    return found


def test_the_redis_gateway_imports_no_file_format() -> None:
    """Issue 32: the store imported hsq.outputs for the manifest codec (store -> outputs ->
    protocol -> stfile). The codec lives beside the output format now; the gateway stores
    done entries through it (hsq.store.DoneCodec) and reaches no file format, directly or
    through another module."""
    assert file_formats_reached(ROOT, "hsq.store") == {}


def test_the_file_format_check_follows_imports_through_other_modules(tmp_path: Path) -> None:
    for pkg in ("hsq", "hsq/store"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "hsq/store/queue.py").write_text("from hsq import runconfig\n")
    (tmp_path / "hsq/runconfig.py").write_text("def f() -> None:\n    from hsq.quant import FP8\n")
    (tmp_path / "hsq/quant.py").write_text("")
    reached = file_formats_reached(tmp_path, "hsq.store")
    assert reached == {"hsq.quant": ["hsq.store.queue", "hsq.runconfig", "hsq.quant"]}


def test_no_file_in_the_repository_is_a_link() -> None:
    """Issue 32: links break a zip download, a core.symlinks=false clone and path-based tools."""
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in listed if line.startswith("120000")]
    assert links == []


def test_the_deployment_units_hold_no_python() -> None:
    """The code lives under hsq/; workers/, producer/, sglang_server/ only deploy it."""
    code = [str(p.relative_to(ROOT)) for d in DEPLOYMENT_UNITS for p in (ROOT / d).rglob("*.py")]
    assert code == []


# The data plane, lowest first: a module imports only from ranks below its own (and its own
# package), so persisting a sample reads one way: outputs -> dump / quant -> stfile -> fsio.
DATA_PLANE = {
    "hsq.states": 0,
    "hsq.fsio": 0,
    "hsq.stfile": 1,
    "hsq.quant": 2,
    "hsq.dump": 2,
    "hsq.outputs": 3,
}


def data_plane_rank(module: str) -> tuple[str, int] | None:
    for name, rank in DATA_PLANE.items():
        if module == name or module.startswith(name + "."):
            return name, rank
    return None


def data_plane_violations(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "hsq").rglob("*.py")):
        module = module_name(path, root)
        mine = data_plane_rank(module)
        if mine is None:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, target in imported(tree, module, path.name == "__init__.py"):
            theirs = data_plane_rank(target)
            if theirs is not None and theirs[0] != mine[0] and theirs[1] >= mine[1]:
                rel = path.relative_to(root)
                found.append(f"{rel}:{line}: {module} (rank {mine[1]}) imports {target}")
            elif target.split(".")[:2] in (["hsq", "workers"], ["hsq", "app"]):
                found.append(f"{path.relative_to(root)}:{line}: {module} imports {target}")
    return found


def test_the_data_plane_imports_one_way() -> None:
    assert data_plane_violations(ROOT) == []


def test_the_data_plane_check_catches_an_import_back_up(tmp_path: Path) -> None:
    (tmp_path / "hsq/stfile").mkdir(parents=True)
    (tmp_path / "hsq/stfile/engine.py").write_text(
        "def f() -> None:\n    from hsq.outputs.transcode import write_output\n"
    )
    (tmp_path / "hsq/dump").mkdir()
    (tmp_path / "hsq/dump/read.py").write_text("from hsq.quant import FP8_CODE\n")
    assert len(data_plane_violations(tmp_path)) == 2


def test_the_hook_settings_and_the_dump_format_load_without_torch() -> None:
    """SGLang's launcher and `hsq launch-sglang` read the hook's settings before torch is
    loaded; a worker copying bf16 dumps never needs torch either."""
    import subprocess
    import sys

    probe = (
        "import sys, hsq.sglang_server.sglang_hook.config, hsq.dump.find, hsq.dump.ready, "
        "hsq.outputs.manifest, hsq.fsio; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
