"""The base install's roles, run for real by an interpreter that has no torch.

`base_roles` is one scenario for any such interpreter: tests/test_slim.py gives it a venv
whose path holds only what hidden-state-queue's base requirements need (links into this
interpreter's site-packages) and the source tree; tests/test_package.py a venv pip built
from the wheel. Both go through real processes: a redis-server, a reference server started
from this (full) interpreter over real HTTP, `hsq enqueue`, `hsq worker`, `hsq status`,
`hsq verify --deep`, `hsq recover` and `hsq exporter` from the torch-less one.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from hsq.node.procs import ManagedProcess, RedisServer, free_port, wait_http_ok
from tests.support.procs import ReferenceServer

DIST_NAME = "hidden-state-queue"
MODEL_MODULES = ("torch", "transformers", "tokenizers", "safetensors", "datasets")
"""What the base install must not have (each comes with an extra, hsq/extras.py)."""


def requirement_closure(reqs: list[str], seen: dict[str, md.Distribution]) -> None:
    """The distributions `reqs` (requirement strings) need, transitively, as installed
    here: markers evaluated for this interpreter, a requirement's extras followed."""
    from packaging.requirements import Requirement

    visited: set[tuple[str, str]] = set()
    todo = list(reqs)
    while todo:
        req = Requirement(todo.pop())
        dist = md.distribution(req.name)
        key = dist.metadata["Name"].lower()
        seen[key] = dist
        for extra in ("", *req.extras):
            if (key, extra) in visited:
                continue
            visited.add((key, extra))
            for dep in dist.requires or []:
                marker = Requirement(dep).marker
                if marker is None or marker.evaluate({"extra": extra}):
                    todo.append(dep)


def base_requirements() -> list[str]:
    """hidden-state-queue's requirements without an extra, from its installed metadata."""
    from packaging.requirements import Requirement

    reqs = md.requires(DIST_NAME) or []
    return [t for t in reqs if (m := Requirement(t).marker) is None or m.evaluate({"extra": ""})]


def link_distributions(seen: dict[str, md.Distribution], links: Path) -> None:
    """Links in `links` to each distribution's top-level files (and its dist-info)."""
    links.mkdir(parents=True, exist_ok=True)
    for dist in seen.values():
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (base / top).exists() and not (links / top).exists():
                (links / top).symlink_to(base / top)


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def linked_base_venv(root: Path, source: Path) -> Path:
    """A venv (no pip: a second) whose path is the base requirements' closure, linked from
    this interpreter, plus the source tree: hsq as the base install has it, without torch."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    seen: dict[str, md.Distribution] = {}
    requirement_closure(base_requirements(), seen)
    assert not set(MODEL_MODULES) & set(seen), f"a model dependency in the base: {sorted(seen)}"
    link_distributions(seen, root / "links")
    (site_packages(venv) / "_hsq_base.pth").write_text(f"{root / 'links'}\n{source}\n")
    return venv / "bin" / "python"


@dataclass(frozen=True)
class Slim:
    """`hsq` run by the torch-less interpreter `python`, cwd `work`, Redis from the env."""

    python: Path
    work: Path
    redis_url: str

    @property
    def env(self) -> dict[str, str]:
        drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
        env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("HSQ")}
        env["HSQ_REDIS_URL"] = self.redis_url  # the URL's password never on a command line
        return env

    def argv(self, *args: str) -> list[str]:
        return [str(self.python), "-m", "hsq", "--log-format", "json", *args]

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            cwd=self.work,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def ok(self, *args: str, timeout: float = 300) -> str:
        proc = self(*args, timeout=timeout)
        assert proc.returncode == 0, (
            f"hsq {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
        return proc.stdout


def token_dataset(path: Path, n: int, seed: int = 29) -> list[str]:
    """`n` token-id lines (ids within the tiny model's vocabulary); their ids."""
    rng = random.Random(seed)
    ids = [f"slim-{i}" for i in range(n)]
    with open(path, "w") as f:
        for sid in ids:
            k = rng.randint(8, 48)
            line = {"id": sid, "input_ids": [rng.randrange(1, 30000) for _ in range(k)]}
            f.write(json.dumps({**line, "loss_mask": [1] * k}) + "\n")
    return ids


def base_roles(slim: Slim, start_server: Callable[[Path], ReferenceServer]) -> dict[str, object]:
    """Every base role once, checked; returns what the caller may want to report."""
    # Nothing of a model is importable: so none of these processes can have loaded it.
    probe = [
        str(slim.python),
        "-c",
        "import importlib.util as u, json; "
        f"print(json.dumps([m for m in {list(MODEL_MODULES)!r} if u.find_spec(m)]))",
    ]
    found = subprocess.run(
        probe, env=slim.env, cwd=slim.work, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(found) == [], f"the base interpreter has {found}"

    n, run, out = 6, "slim", slim.work / "out"
    ids = token_dataset(slim.work / "data.jsonl", n)
    enq = slim.ok(
        "enqueue", str(slim.work / "data.jsonl"), "--run", run, "--out", str(out), "--no-progress"
    )
    assert f"enqueued        {n} samples" in enq, enq

    dumps = slim.work / "dumps"
    dumps.mkdir()
    srv = start_server(dumps)  # the full install's reference server: real HTTP
    try:
        slim.ok(
            "worker",
            "--run",
            run,
            "--server",
            srv.url,
            "--dump-dir",
            str(dumps),
            "--burst",
            timeout=600,
        )
    finally:
        srv.stop()

    status = json.loads(slim.ok("status", "--run", run, "--json"))
    assert (status["done"], status["dead"], status["total"]) == (n, 0, n), status
    deep = slim.ok("verify", "--run", run, "--deep", "--no-progress")
    assert f"checked {n}: ok {n}, missing 0, corrupt 0" in deep, deep
    assert slim.ok("runs").split() == [run, "done", f"{n}/{n}", "dead", "0"]

    # recover rebuilds the state from the files (every tensor read, numpy only)
    slim.ok("purge", "--run", run, "--yes")
    rec = slim.ok(
        "recover", str(slim.work / "data.jsonl"), "--run", run, "--out", str(out), "--no-progress"
    )
    assert json.loads(slim.ok("status", "--run", run, "--json"))["done"] == n, rec

    port = free_port()
    exporter = ManagedProcess(
        slim.argv("exporter", "--metrics-port", str(port)), slim.work / "exp.log", env=slim.env
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/metrics", exporter, timeout=60)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        exporter.stop()
    assert f'hsq_run_samples{{run="{run}",state="done"}} {float(n)}' in metrics, metrics

    # A role that needs a model: one line naming the extra, exit 2, nothing started.
    refused = slim("serve-reference", "--dump-dir", str(dumps))
    assert refused.returncode == 2, refused
    assert refused.stderr.strip().splitlines() == [
        "error: hsq serve-reference needs torch, safetensors, transformers, tokenizers, "
        f"not installed here: pip install '{DIST_NAME}[reference]'"
    ], refused.stderr
    return {"ids": ids, "status": status}


__all__ = ["RedisServer", "Slim", "base_roles", "linked_base_venv"]
