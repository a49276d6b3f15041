#!/usr/bin/env bash
# A venv for SpecForge 0.2.0's trainer beside hsq's (docs/training.md, "Where each trainer
# lives"): SpecForge's own pin of transformers (5.8.1), not hsq's 5.24.0. The offline path
# reads hsq's export from disk and needs nothing of hsq; the streamed one
# (examples/train_eagle3_from_stream.py) reads hsq's stream, so the venv also gets hsq's
# base install, whose dependencies (redis, rq, msgspec, numpy, ...) pin neither torch nor
# transformers (editable: this checkout's hsq).
#   scripts/specforge_venv.sh DIR
# On a GPU training host take every pin SpecForge declares instead:
#   python3.11 -m venv DIR && DIR/bin/pip install specforge==0.2.0   (torch 2.11 CUDA, sglang)
# This script is that venv for a CPU (tests/test_specforge_train.py runs SpecForge's trainer
# in it): TORCH_SPEC (default: the torch of .venv, the CPU build `make setup` installed;
# SpecForge's own pin is TORCH_SPEC=torch==2.11.0 with
# TORCH_INDEX=https://download.pytorch.org/whl/cpu where that index is reachable),
# transformers==5.8.1, and specforge --no-deps with the
# packages its trainer imports. Left out, as a CPU `specforge train` imports none of them:
# sglang (serving; its CUDA torch pins), wandb and tensorboard (loggers), yunchang (sequence
# parallelism), openai-harmony. triton: SpecForge's loss module imports it even on a CPU,
# where tests.support.specforge_cpu swaps the kernel for SpecForge's reference loss.
set -euo pipefail
cd "$(dirname "$0")/.."
# Nothing from the caller's path: with hsq's tests' PYTHONPATH (.trainers/ holds specforge's
# code) pip took specforge as installed already and left it out of the venv.
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
DIR=${1:?usage: scripts/specforge_venv.sh DIR}
PY=${PYTHON:-python3}
if [ -z "${TORCH_SPEC:-}" ]; then
  TORCH_SPEC="torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
fi
say() { printf '[specforge-venv] %s\n' "$*"; }

rm -rf "$DIR"
"$PY" -m venv "$DIR"
pip=("$DIR/bin/python" -m pip --disable-pip-version-check)
say "installing $TORCH_SPEC"
"${pip[@]}" install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "$TORCH_SPEC" >"$pin"
say "installing transformers==5.8.1 (SpecForge's pin) and its trainer's imports"
"${pip[@]}" install -q -c "$pin" transformers==5.8.1 accelerate==1.15.0 datasets==5.1.0 \
  pydantic psutil pyyaml safetensors huggingface-hub numpy requests tqdm typing-extensions
"${pip[@]}" install -q --no-deps specforge==0.2.0 triton==3.9.0
say "installing hidden-state-queue (base install, editable) for the stream reader"
"${pip[@]}" install -q -c "$pin" -e .
"$DIR/bin/python" -c 'import specforge.cli, transformers, torch, hsq.data.stream
print(f"specforge venv: transformers {transformers.__version__}, torch {torch.__version__}")'
