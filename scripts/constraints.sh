#!/usr/bin/env bash
# `make constraints`: writes constraints.txt, the version of every package hsq, its extras
# and its dev tools pull in (transitively), as installed in .venv by `make setup`. Installs with it are
# reproducible: `make setup` and tests/test_package.py use it, and so can anyone:
#   pip install -c constraints.txt hidden-state-queue
# Left out: torch and its CUDA-only packages (a CPU host installs TORCH_SPEC, a GPU host keeps
# the CUDA build it has) and hsq itself. Re-run it after changing a dependency, then run the
# tests; CI installs exactly these versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" - >constraints.txt <<'PYEOF'
import importlib.metadata as md
import re

from packaging.requirements import Requirement

SKIP = re.compile(r"^(torch|triton|nvidia-.*|hidden-state-queue)$")
seen: set[str] = set()
pins: dict[str, str] = {}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def walk(name: str, extras: set[str]) -> None:
    """`name` and what it requires with these extras (markers evaluated here)."""
    dist = md.distribution(name)
    key = norm(dist.metadata["Name"])
    if key in seen:
        return
    seen.add(key)
    if not SKIP.match(key):
        pins[key] = dist.version
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            walk(req.name, set(req.extras))


# Every extra by name: `all` names hidden-state-queue itself, which walk() has seen by then.
walk("hidden-state-queue", set(md.metadata("hidden-state-queue").get_all("Provides-Extra") or []))
print("# The versions CI installs (scripts/constraints.sh, from .venv after `make setup`).")
print("# torch is not here: a CPU host installs TORCH_SPEC, a GPU host keeps its CUDA build.")
for key in sorted(pins):
    print(f"{key}=={pins[key]}")
PYEOF
echo "constraints.txt: $(grep -c '==' constraints.txt) packages"
