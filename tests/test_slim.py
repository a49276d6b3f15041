"""The base install (no torch, transformers, tokenizers) serves the roles that run no model;
a role that needs an extra says which, in one line.

The end-to-end test runs the real processes under a venv whose path holds only the closure
of hidden-state-queue's base requirements, linked from this venv, and the source tree
(tests/slim.py): seconds to build, no network. tests/test_package.py does the same from the
wheel pip installs (marker `package`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hsq import extras
from hsq.errors import ConfigError, MissingExtraError
from tests.slim import MODEL_MODULES, Slim, base_roles, linked_base_venv
from tests.support.procs import ReferenceServer

ROOT = Path(__file__).resolve().parents[1]

# The entry modules of the base roles: the CLI and every command module, the worker, the
# producer, status, verify/recover, the exporter.
BASE_ENTRY_MODULES = (
    "hsq",
    "hsq.cli.main",
    "hsq.cli.commands.admin",
    "hsq.cli.commands.status",
    "hsq.cli.commands.produce",
    "hsq.cli.commands.recover",
    "hsq.cli.commands.verify",
    "hsq.cli.commands.serve",
    "hsq.ops.prometheus",
    "hsq.workers.worker",
    "hsq.producer.enqueue",
    "hsq.outputs.check",
    "hsq.outputs.adopt",
    "hsq.ops",
)


def test_the_base_roles_entry_modules_import_no_model_library() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(BASE_ENTRY_MODULES)!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(m for m in {list(MODEL_MODULES)!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_a_missing_extra_is_one_line_naming_the_pip_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(extras.EXTRAS, "export", ("torch", "hsq_no_such_module_29"))
    with pytest.raises(MissingExtraError) as caught:
        extras.require("export", "hsq export --format specforge")
    assert str(caught.value) == (
        "hsq export --format specforge needs hsq_no_such_module_29, not installed here: "
        "pip install 'hidden-state-queue[export]'"
    )
    assert isinstance(caught.value, ConfigError)  # the CLI's exit 2
    extras.require("fp8", "a worker")  # installed here: no error


def test_an_unchecked_import_of_an_optional_module_names_every_extra_that_brings_it() -> None:
    err = extras.extra_error(
        ModuleNotFoundError("No module named 'datasets.table'", name="datasets.table")
    )
    assert (
        str(err) == "datasets is not installed here: pip install 'hidden-state-queue[speculators]'"
    )
    assert extras.extra_error(ModuleNotFoundError("x", name="hsq_nope")) is None


def test_every_extra_in_pyproject_is_the_one_hsq_extras_names() -> None:
    """hsq/extras.py and pyproject.toml's extras list the same distributions per role."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    base = {d.split(">")[0].split("[")[0].split("=")[0] for d in project["dependencies"]}
    assert not base & set(MODEL_MODULES), "a model library in the base dependencies"
    for extra, modules in extras.EXTRAS.items():
        dists = {d.split(">")[0].split("<")[0].split("=")[0] for d in optional[extra]}
        assert dists == set(modules), extra
    assert optional["all"] == [
        f"hidden-state-queue[{','.join(sorted(extras.EXTRAS, key=list(optional).index))}]"
    ]


@pytest.mark.timeout(600)
def test_the_base_install_runs_the_queue_worker_verify_recover_and_exporter_without_torch(
    tmp_path: Path, redis_url: str
) -> None:
    # redis_url: an empty database, since `hsq runs` lists every run in it
    python = linked_base_venv(tmp_path / "base", ROOT)
    work = tmp_path / "work"
    work.mkdir()

    def start(dumps: Path) -> ReferenceServer:  # from this, the full, install
        return ReferenceServer(dumps, work / "server.log", args=["--threads", "2"]).wait_ready()

    base_roles(Slim(python, work, redis_url), start)
