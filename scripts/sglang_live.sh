#!/usr/bin/env bash
# sglang_live.sh [bench/sglang_live.py ARGS | --exec CMD ...]: on a GPU machine without a registry, install the
# bundle of scripts/sglang_wheelhouse.sh and this checkout, then run the live SGLang test.
#
#   WHEELHOUSE=.wheelhouse  the bundle (wheels/, sgl_kernel.tar.gz, redis/)
#   SITE=/tmp/hsq-site      install target, put first on PYTHONPATH (kept between calls on
#                           the same machine: a second run skips the install)
#   CACHE=/tmp/hsq-live-cache  JIT caches (tvm-ffi, triton, flashinfer); JIT_CACHE_IN, if
#                           set, is a tar.gz of an earlier machine's caches to start from
# The base environment (torch 2.11 cu130, triton, transformers, safetensors, httpx,
# prometheus-client, nvcc) is used as it is. Nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELHOUSE=${WHEELHOUSE:-.wheelhouse}
SITE=${SITE:-/tmp/hsq-site}
CACHE=${CACHE:-/tmp/hsq-live-cache}
PY=${PY:-python3}
[ -x /opt/torch/.venv/bin/python3 ] && PY=${PY_OVERRIDE:-/opt/torch/.venv/bin/python3}
say() { printf '[sglang_live.sh] %s\n' "$*"; }

if [ ! -f "$SITE/.hsq-installed" ]; then
  [ -d "$WHEELHOUSE/wheels" ] || { say "no $WHEELHOUSE/wheels: run scripts/sglang_wheelhouse.sh"; exit 2; }
  rm -rf "$SITE"
  mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$SITE" "$WHEELHOUSE"/wheels/*.whl
  if ! "$PY" -c 'import pydantic, sys; sys.exit(0 if int(pydantic.VERSION.split(".")[0]) >= 2 else 1)' 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
      "$WHEELHOUSE"/wheels/if-missing/*.whl
  fi
  tar -xzf "$WHEELHOUSE/sgl_kernel.tar.gz" -C "$SITE"
  # sglang imports these at module level and never uses them for text serving.
  if ! "$PY" -c 'import IPython.display' 2>/dev/null; then
    mkdir -p "$SITE/IPython"
    printf '"""Stub: sglang notebook helpers only."""\n' >"$SITE/IPython/__init__.py"
    printf 'class HTML:\n    def __init__(self, data=None, *a, **k):\n        self.data = data\n\n\ndef display(*objs, **kw):\n    print(*objs)\n' >"$SITE/IPython/display.py"
  fi
  if ! "$PY" -c 'import soundfile' 2>/dev/null; then
    printf '"""Stub: sglang realtime audio only."""\n\n\ndef _missing(*a, **k):\n    raise RuntimeError("no soundfile in this offline install")\n\n\nwrite = read = info = _missing\n' >"$SITE/soundfile.py"
  fi
  # hsq itself, as a user installs it into SGLang's environment: registers the
  # sglang.srt.plugins entry point that SGLang's load_plugins() finds. The wheel `make dist`
  # built (carried in dist/), else this checkout (needs setuptools >= 77 there).
  src=.
  for w in dist/hidden_state_queue-*.whl; do [ -f "$w" ] && src=$w; done
  if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" "$src" \
    >"$SITE/.hsq-pip.log" 2>&1; then
    say "pip could not install this checkout (see below); the live run needs the entry point"
    tail -20 "$SITE/.hsq-pip.log"
    exit 2
  fi
  rm -rf build ./*.egg-info
  if [ "${STUB_CUTLASS:-0}" = 1 ] && ! "$PY" -c 'import cutlass' 2>/dev/null; then
    # Test-only: SGLang 0.5.15's DeepSeek model module imports nvidia-cutlass-dsl (150 MB,
    # too big for one transfer) for Blackwell kernels the triton backend never calls. A
    # permissive stand-in lets the module import; any real use of it fails loudly.
    mkdir -p "$SITE/cutlass"
    cp bench/cutlass_stub.py "$SITE/cutlass/__init__.py"
    say "cutlass stand-in written (STUB_CUTLASS=1)"
  fi
  touch "$SITE/.hsq-installed"
  say "installed into $SITE ($(du -sh "$SITE" | cut -f1))"
fi

mkdir -p "$CACHE/bin"
if [ -n "${JIT_CACHE_IN:-}" ] && [ -f "$JIT_CACHE_IN" ] && [ ! -f "$CACHE/.restored" ]; then
  tar -xzf "$JIT_CACHE_IN" -C "$CACHE" && touch "$CACHE/.restored" && say "JIT caches restored"
fi
cp -f "$WHEELHOUSE"/redis/redis-server "$CACHE/bin/" 2>/dev/null || true
export PATH="$CACHE/bin:$PATH"
export LD_LIBRARY_PATH="$(cd "$WHEELHOUSE/redis" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TVM_FFI_CACHE_DIR="$CACHE/tvm-ffi" TRITON_CACHE_DIR="$CACHE/triton"
export FLASHINFER_WORKSPACE_BASE="$CACHE" XDG_CACHE_HOME="$CACHE/xdg"
# tvm-ffi finds CUDA through CUDA_HOME (nvcc may be a wrapper script elsewhere on PATH).
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
    if [ -x "$d/bin/nvcc" ]; then export CUDA_HOME=$d; break; fi
  done
fi
export PATH="${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"
say "python $("$PY" -c 'import sys, torch, sglang; print(sys.version.split()[0], "torch", torch.__version__, "sglang", sglang.__version__)'), CUDA_HOME=${CUDA_HOME:-unset}"
# `sglang_live.sh --exec CMD ARGS`: run another command in this environment (benchmarks).
if [ "${1:-}" = --exec ]; then shift; exec "$@"; fi
exec "$PY" bench/sglang_live.py "$@"
