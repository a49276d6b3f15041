"""The import rules (docs/architecture.md), checked over the tree's own imports: the
folders are the layers, and an import goes down the table, never up or sideways.

    0 kernel    hsq/*.py (stdlib only: errors keys settings states jsonsafe redisurl
                runconfig logs extras fsio) and hsq/__init__.py
    1 formats   hsq/dataset/ hsq/dump/ hsq/stfile/ hsq/quant.py hsq/outputs/ hsq/closeness/
    2 store     hsq/store/ (the Redis gateway) and hsq/runstore.py (the gateway bound to the
                manifest codec: where the store and the output format meet)
    3 services  hsq/producer/ hsq/workers/ hsq/engines/ hsq/data/: each imports the layers
                below and itself, never another service
    4 node/ops  hsq/ops/ (status, verify, requeue, audit, export, the Prometheus exporter),
                then hsq/node/ (`hsq run`: it verifies through ops)
    5 cli       hsq/cli/ and hsq/__main__.py: the click layer only

tests/support/ (the zygote, the null and fake-vLLM servers, toy tokenizer, tiny model) may
import anything; nothing in hsq imports it, nor tests/, bench/ or examples/. hsq never
imports a trainer (SpecForge, speculators): they live in venvs of their own; examples/
(a trainer over hsq's stream) imports hsq and a trainer. A top-level `workers`,
`producer` or `sglang_server` import is always wrong: those names are not installed, only
`hsq` is. The repository's top-level workers/, producer/ and sglang_server/ are deployment
units (README, env example, recipes) and hold no Python.

Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hsq",)
DEPLOYMENT_UNITS = ("workers", "producer", "sglang_server")
KERNEL = (
    "errors",
    "keys",
    "settings",
    "states",
    "jsonsafe",
    "redisurl",
    "runconfig",
    "logs",
    "extras",
    "fsio",
)
FOLDERS: dict[str, tuple[int, str]] = {
    **{f"hsq.{m}": (0, "kernel") for m in KERNEL},
    **{f"hsq.{m}": (1, "formats") for m in ("dataset", "dump", "stfile", "quant", "outputs")},
    "hsq.closeness": (1, "formats"),
    "hsq.store": (2, "store"),
    "hsq.runstore": (2, "store"),
    **{f"hsq.{m}": (3, f"hsq.{m}") for m in ("producer", "workers", "engines", "data")},
    "hsq.ops": (4, "ops"),
    "hsq.node": (5, "node"),
    "hsq.cli": (6, "cli"),
    "hsq.__main__": (6, "cli"),
}
MAX_LOOSE_MODULES = 12
"""Modules directly under hsq/ besides __init__ and __main__: the kernel, hsq.quant and
hsq.runstore. A new concern gets a folder of its own."""


def layer(module: str) -> tuple[int, str] | None:
    """(rank, name) of a first-party module (dotted name); None for anything else."""
    top = module.split(".")[0]
    if top in DEPLOYMENT_UNITS:
        return (-1, "uninstalled")  # the bare directory names: never importable once installed
    if module == "hsq" or (module.startswith("hsq.__") and module != "hsq.__main__"):
        # the package itself: its dunders are the kernel's; its lazy public API (PEP 562) is
        # checked as the source below
        return (0, "kernel")
    parts = module.split(".")
    for i in range(len(parts), 1, -1):
        found = FOLDERS.get(".".join(parts[:i]))
        if found:
            return found
    if top == "hsq":
        return (99, "unplaced")  # a module no folder holds: the check names it
    if top in ("tests", "bench", "deploy", "examples"):
        return (100, top)
    return None


def allowed(mine: tuple[int, str], theirs: tuple[int, str]) -> bool:
    if theirs[1] in ("uninstalled", "unplaced") or theirs[0] >= 100:
        return False
    if mine == theirs:
        return True
    return theirs[0] < mine[0]


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
            mine = (5, "api") if module == "hsq" else layer(module)
            assert mine is not None
            rel = path.relative_to(root)
            if mine[1] == "unplaced":
                found.append(f"{rel}: {module} is in no layer's folder")
                continue
            tree = ast.parse(path.read_text(), str(path))
            for line, target in imported(tree, module, path.name == "__init__.py"):
                theirs = layer(target)
                if theirs and not allowed(mine, theirs):
                    found.append(f"{rel}:{line}: {mine[1]} {module} imports {theirs[1]} {target}")
    return found


def loose_modules(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "hsq").glob("*.py") if not p.name.startswith("__"))


def test_at_most_twelve_loose_modules() -> None:
    assert len(loose_modules(ROOT)) <= MAX_LOOSE_MODULES, loose_modules(ROOT)


def test_imports_follow_the_layers() -> None:
    assert violations(ROOT) == []


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("hsq/keys.py", "from hsq.ops import run_status\n"),
        ("hsq/keys.py", "def f() -> None:\n    import hsq.workers.worker\n"),
        ("hsq/stfile/engine.py", "from tests.support import procs\n"),
        ("hsq/workers/worker.py", "from hsq.producer.enqueue import enqueue\n"),
        ("hsq/producer/enqueue.py", "from hsq.ops import status\n"),
        ("hsq/engines/reference/app.py", "from hsq.workers.send import client\n"),
        ("hsq/node/procs.py", "from hsq.cli.main import main\n"),
        ("hsq/workers/send/client.py", "from ...cli import main\n"),
        ("hsq/cli/main.py", "import workers.worker\n"),
        ("hsq/store/queue.py", "from hsq.workers import claims\n"),
        ("hsq/ops/status.py", "from hsq.node import supervisor\n"),
        ("hsq/cli/main.py", "from tests.support import zygote\n"),
        ("hsq/newthing.py", "import json\n"),
    ],
)
def test_the_check_catches_a_wrong_way_import(tmp_path: Path, path: str, source: str) -> None:
    for pkg in ("hsq", "hsq/workers", "hsq/producer", "hsq/engines"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(source)
    assert len(violations(tmp_path)) == 1, source


def test_the_cli_may_import_every_layer_of_hsq(tmp_path: Path) -> None:
    (tmp_path / "hsq/cli").mkdir(parents=True)
    (tmp_path / "hsq/cli/main.py").write_text(
        "import hsq.workers.worker\nimport hsq.producer.enqueue\nfrom hsq.node import procs\n"
    )
    assert violations(tmp_path) == []


# Only the store (the package hsq.store) talks to Redis; hsq.node.procs starts redis-server
# and pings it.
REDIS_IMPORTERS = {"hsq.store", "hsq.node.procs"}


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
    (tmp_path / "hsq/workers/send").mkdir(parents=True)
    (tmp_path / "hsq/workers/send/client.py").write_text(
        "def f() -> None:\n    from rq import Queue\n"
    )
    assert redis_importers(tmp_path) == {"hsq.workers.send.client"}


# The file formats: what a dump, an output file and its storage encoding look like.
FILE_FORMATS = ("hsq.outputs", "hsq.dump", "hsq.stfile", "hsq.quant")


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
    """The store imported hsq.outputs for the manifest codec (store -> outputs ->
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


TRAINERS = ("specforge", "speculators")


def trainer_imports(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "hsq").rglob("*.py")):
        module = module_name(path, root)
        tree = ast.parse(path.read_text(), str(path))
        for line, target in imported(tree, module, path.name == "__init__.py"):
            if target.split(".")[0] in TRAINERS:
                found.append(f"{path.relative_to(root)}:{line}: {target}")
    return found


def test_hsq_imports_no_trainer(tmp_path: Path) -> None:
    """SpecForge and speculators pin what hsq's venv cannot hold (docs/training.md, "Where
    each trainer lives"): hsq writes their formats and never imports their code."""
    assert trainer_imports(ROOT) == []
    (tmp_path / "hsq" / "ops").mkdir(parents=True)
    (tmp_path / "hsq" / "ops" / "x.py").write_text("def f() -> None:\n    import specforge\n")
    assert len(trainer_imports(tmp_path)) == 1
    (tmp_path / "hsq" / "ops" / "x.py").write_text("from examples import train\n")
    assert len(violations(tmp_path)) == 1


def test_no_file_in_the_repository_is_a_link() -> None:
    """Links break a zip download, a core.symlinks=false clone and path-based tools."""
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
        "import sys, hsq.engines.sglang.config, hsq.dump.find, hsq.dump.ready, "
        "hsq.outputs.manifest, hsq.fsio; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def import_circles(root: Path) -> list[list[str]]:
    """Each circle of first-party imports (lazy ones included), as one chain that closes."""
    graph = first_party_imports(root)
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph.get(module, set()) - {module}):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return circles


def test_no_module_imports_itself_back_through_others() -> None:
    """A circle makes import order matter (a name half-defined when the other side runs)
    and hides which module is the lower one; a module that both sides need goes below."""
    assert import_circles(ROOT) == []


def test_the_circle_check_sees_a_lazy_import_back(tmp_path: Path) -> None:
    (tmp_path / "hsq/dataset").mkdir(parents=True)
    (tmp_path / "hsq/dataset/jsonl.py").write_text(
        "def f() -> None:\n    import hsq.dataset.fast\n"
    )
    (tmp_path / "hsq/dataset/fast.py").write_text("from hsq.dataset.jsonl import f\n")
    assert len(import_circles(tmp_path)) == 1


def test_no_test_module_imports_another() -> None:
    """What several test files share lives in tests/support (or tests/helpers.py): a test
    module imported by another runs its fixtures and module state twice and hides which
    file a helper belongs to."""
    found = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        module = module_name(path, ROOT)
        tree = ast.parse(path.read_text(), str(path))
        for line, target in imported(tree, module, path.name == "__init__.py"):
            if target.startswith("tests.test_"):
                found.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert found == []
