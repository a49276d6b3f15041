#!/usr/bin/env bash
# Creates .venv/ with hsq and its dev tools, and installs the system services the tests use
# (redis-server, prometheus with promtool; Debian packages).
#   CPU host: the CPU build of torch (TORCH_SPEC, default torch==2.13.0); never a CUDA build.
#   GPU host (nvidia-smi works and the system python has CUDA torch): the venv sees that torch.
# TORCH_INDEX=<url> points pip at a CPU wheel index on hosts without a local torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
say() { printf '[setup] %s\n' "$*"; }

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
# Prometheus and promtool: the monitoring tests scrape a live run with a real Prometheus.
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || need_apt+=(prometheus)
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
    say "missing ${need_apt[*]} and no root: install them, then re-run"; exit 1; fi
  say "installing ${need_apt[*]} (Debian packages)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

gpu_torch=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 &&
   "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  gpu_torch=1
fi

if [ ! -x .venv/bin/python ]; then
  if ((gpu_torch)); then
    say "GPU host: the venv uses the system's CUDA torch"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
# torch does not depend on NumPy but warns "Failed to initialize NumPy" at every import
# without it (the torch checks below printed it twice): the pinned NumPy goes in first.
.venv/bin/python -c 'import numpy' 2>/dev/null || "${pip[@]}" install -q -c constraints.txt numpy

if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  say "installing $TORCH_SPEC (CPU build)"
  "${pip[@]}" install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
fi
torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
if ((!gpu_torch)) && ! .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.version.cuda is None else 1)'; then
  say "warning: a CUDA build of torch is in .venv on a host without a usable GPU"
fi
# Pin the torch we have so no dependency can pull another (multi-GB) build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_version" >"$constraints"
# Before 0.2.0 the distribution was called `hsq`: an old editable install would register
# the SGLang plugin a second time.
if "${pip[@]}" show -q hsq >/dev/null 2>&1; then
  say "removing the old distribution 'hsq' (now hidden-state-queue)"
  "${pip[@]}" uninstall -q -y hsq
fi
# constraints.txt: the versions CI tested (scripts/constraints.sh). Every extra (the roles'
# dependencies, docs/install.md) and the dev tools: the suite runs every role.
say "installing hidden-state-queue[all,dev] (editable)"
"${pip[@]}" install -q -c "$constraints" -c constraints.txt -e '.[all,dev]'
# What the tests that run SpecForge's trainer and speculators' loader import beside hsq,
# resolved into .venv with hsq's pins (all of it satisfiable, so `pip check` stays clean):
# accelerate and triton (SpecForge's loss module imports triton even on a CPU, where
# tests.support.specforge_cpu swaps the kernel for SpecForge's reference loss), openai and
# hs-connectors (speculators' loader).
say "installing SpecForge's trainer imports and speculators==0.9.0's loader imports (pinned)"
"${pip[@]}" install -q -c "$constraints" openai==3.51.0 accelerate==1.15.0 hs-connectors==0.9.0
# A GPU host's venv sees the triton its CUDA torch was built with: never replace that one.
.venv/bin/python -c 'import triton' 2>/dev/null || "${pip[@]}" install -q --no-deps triton==3.9.0
# SpecForge and speculators themselves pin what hsq's venv cannot hold (specforge 0.2.0:
# torch==2.11.0, transformers==5.8.1, sglang==0.5.14; speculators 0.9.0: transformers
# <=5.19.0), so they are not installed into .venv: their code goes to .trainers/ (no
# dependencies, not an environment), which the tests put on their path (tests/conftest.py)
# to compare hsq's tokenize and export with SpecForge's parser and reader and to run the
# CPU trainer test. A real trainer lives in its own venv with its own pins (docs/training.md).
say "installing specforge==0.2.0 and speculators==0.9.0 code into .trainers/ (tests only)"
# A venv made before this kept them in .venv itself: take them out.
for old in specforge speculators; do
  if "${pip[@]}" show -q "$old" >/dev/null 2>&1; then "${pip[@]}" uninstall -q -y "$old"; fi
done
rm -rf .trainers
"${pip[@]}" install -q --no-deps --target .trainers specforge==0.2.0 speculators==0.9.0
say "fetching pinned SGLang wheels (read as source by tests/test_sglang_conformance.py)"
./scripts/fetch_sglang_sources.sh
# No unmet or conflicting requirement in the venv this made (CI fails on one).
"${pip[@]}" check
say "done: torch $torch_version, $(.venv/bin/hsq --version)"
