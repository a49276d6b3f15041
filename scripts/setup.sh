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
# constraints.txt: the versions CI tested (scripts/constraints.sh).
say "installing hidden-state-queue (editable) with dev tools"
"${pip[@]}" install -q -c "$constraints" -c constraints.txt -e '.[dev]'
# SpecForge's trainer runs for real in tests/test_specforge_train.py: it imports accelerate,
# datasets and triton (its loss module imports triton at import time, even on a CPU where
# hsq.harness.specforge_cpu swaps the kernel for SpecForge's reference loss). vLLM
# speculators' loader (tests/test_training.py) imports datasets, openai and hs_connectors.
# Resolved installs first, so pip does not list specforge's unmet pins as errors after it.
say "installing SpecForge's trainer imports and speculators==0.9.0's loader (pinned)"
"${pip[@]}" install -q -c "$constraints" datasets==5.1.0 openai==3.51.0
# SpecForge's own parser and reader check hsq's tokenize and export (tests/test_chat.py,
# tests/test_training.py). --no-deps: its pins (torch 2.11, sglang, ...) are not needed by
# the modules the tests import (torch, transformers, pydantic only).
say "installing specforge==0.2.0 --no-deps (tests compare against its parser and reader)"
"${pip[@]}" install -q --no-deps specforge==0.2.0
# --no-deps: their pins (torch, transformers, vllm) are not needed by the modules tested.
"${pip[@]}" install -q --no-deps accelerate==1.15.0 speculators==0.9.0 hs-connectors==0.9.0
# A GPU host's venv sees the triton its CUDA torch was built with: never replace that one.
.venv/bin/python -c 'import triton' 2>/dev/null || "${pip[@]}" install -q --no-deps triton==3.9.0
say "fetching pinned SGLang wheels (read as source by tests/test_sglang_conformance.py)"
./scripts/fetch_sglang_sources.sh
say "done: torch $torch_version, $(.venv/bin/hsq --version)"
