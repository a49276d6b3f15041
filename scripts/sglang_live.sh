#!/usr/bin/env bash
# sglang_live.sh [OPTIONS] [-- PYTEST ARGS]: on a GPU machine without a registry, install the
# bundle of scripts/sglang_wheelhouse.sh (and the cutlass pack of scripts/sglang_cutlass.sh)
# and this checkout, then run the live GPU tests (tests/gpu, `pytest -m gpu`) or a command.
#
#   --sglang-version V   the bundle must hold SGLang V (its VERSION file); the tests check
#                        the installed one too. Default: whatever the bundle holds.
#   --tp N               tensor-parallel size of every server the tests start (default 1)
#   --cutlass FILE       unpack nvidia-cutlass-dsl (cutlass-cu13.tar.xz) into the site dir
#                        (DeepSeek/Kimi need it); a second device call, made within 30 s of
#                        the one that installed the bundle, finds that install in /tmp
#   --part DIR           one part of a bundle too big for one device call (scripts/sglang_parts.sh
#                        splits it): copied into STASH; once STASH holds every file the parts'
#                        PARTS list names, it is the bundle that is installed. Repeatable
#   --stash-only         with --part: keep the part in STASH and stop (exit 0); the call with
#                        the other part must come within 30 s (the warm machine keeps /tmp)
#   --results DIR        results JSON and logs (default: $OUT if set, else ./live-results)
#   --job NAME=ARGS      a pytest job (ARGS: pytest arguments); several run at once, each with
#                        its own work dir, Redis, JIT caches and results file. Default: one
#                        job, `all`, running tests/gpu (or the ARGS after --)
#   --test-timeout S     stop a test after S seconds (pytest-timeout): it fails with its
#                        traceback and what it measured so far, and the logs are still
#                        packed (a device call ends hard at its limit)
#   --exec CMD ...       run CMD in the installed environment instead (benchmarks:
#                        --exec python3 -m bench.sglang_capacity --json $OUT/cap.json)
#   --dry-run            check the options and print the plan; install and run nothing
# Environment: WHEELHOUSE (.wheelhouse), SITE (/tmp/hsq-site), CACHE (/tmp/hsq-live-cache),
# WORK (/tmp/hsq-live), STASH (/tmp/hsq-wheelhouse). The base image's torch 2.11 cu130, triton, transformers, safetensors,
# httpx and nvcc are used as they are; nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELHOUSE=${WHEELHOUSE:-.wheelhouse}
SITE=${SITE:-/tmp/hsq-site}
CACHE=${CACHE:-/tmp/hsq-live-cache}
WORK=${WORK:-/tmp/hsq-live}
STASH=${STASH:-/tmp/hsq-wheelhouse}
PY=${PY:-python3}
[ -x /opt/torch/.venv/bin/python3 ] && PY=${PY_OVERRIDE:-/opt/torch/.venv/bin/python3}
say() { printf '[sglang_live.sh] %s\n' "$*"; }
die() { say "$*" >&2; exit 2; }

version="" tp=1 cutlass="" test_timeout=0 results="${OUT:-$PWD/live-results}" dry=0
jobs=() exec_cmd=() parts=() stash_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --sglang-version) [ $# -ge 2 ] || die "--sglang-version needs a value"; version=$2; shift 2 ;;
    --tp) [ $# -ge 2 ] || die "--tp needs a value"; tp=$2; shift 2 ;;
    --cutlass) [ $# -ge 2 ] || die "--cutlass needs a file"; cutlass=$2; shift 2 ;;
    --test-timeout) [ $# -ge 2 ] || die "--test-timeout needs seconds"; test_timeout=$2; shift 2 ;;
    --results) [ $# -ge 2 ] || die "--results needs a folder"; results=$2; shift 2 ;;
    --part) [ $# -ge 2 ] || die "--part needs a folder"; parts+=("$2"); shift 2 ;;
    --stash-only) stash_only=1; shift ;;
    --job) [ $# -ge 2 ] || die "--job needs NAME=ARGS"; jobs+=("$2"); shift 2 ;;
    --exec) shift; exec_cmd=("$@"); [ ${#exec_cmd[@]} -gt 0 ] || die "--exec needs a command"; break ;;
    --dry-run) dry=1; shift ;;
    --) shift; jobs+=("all=$*"); break ;;
    *) die "unknown option $1 (see the header of $0)" ;;
  esac
done
[[ "$tp" =~ ^[1-9][0-9]*$ ]] || die "--tp $tp: expected an integer >= 1"
[[ "$test_timeout" =~ ^[0-9]+$ ]] || die "--test-timeout $test_timeout: expected seconds"
[ -z "$version" ] || [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--sglang-version $version: expected X.Y.Z"
[ -z "$cutlass" ] || [ -f "$cutlass" ] || die "--cutlass $cutlass: no such file"
[ ${#jobs[@]} -gt 0 ] || jobs=("all=tests/gpu")
names=()
for j in "${jobs[@]}"; do
  name=${j%%=*}
  [[ "$j" == *=* && "$name" =~ ^[A-Za-z0-9_-]+$ ]] || die "--job $j: expected NAME=PYTEST ARGS"
  for n in "${names[@]}"; do [ "$n" != "$name" ] || die "--job $name given twice"; done
  names+=("$name")
done
[ "$stash_only" = 0 ] || [ ${#parts[@]} -gt 0 ] || die "--stash-only needs --part"
# A bundle in parts: each part's files go to STASH; the bundle is STASH once it is whole.
missing_in() {  # missing_in DIR...: how many files of PARTS none of the DIRs holds (size too)
  local n=0 rel size d found
  while read -r rel size; do
    found=0
    for d in "$@"; do
      if [ "$(stat -c %s "$d/$rel" 2>/dev/null)" = "$size" ]; then found=1; break; fi
    done
    [ "$found" = 1 ] || n=$((n + 1))
  done <"$1/PARTS"
  echo "$n"
}
if [ ${#parts[@]} -gt 0 ]; then
  for d in "${parts[@]}"; do
    [ -f "$d/PARTS" ] && [ -f "$d/VERSION" ] || die "--part $d: no PARTS or VERSION (scripts/sglang_parts.sh)"
  done
  if [ "$dry" = 1 ]; then
    say "plan: parts ${parts[*]} into $STASH ($(missing_in "${parts[@]}") of $(wc -l <"${parts[0]}/PARTS") bundle files not in them)"
    WHEELHOUSE=${parts[0]}
  else
    mkdir -p "$STASH"
    for d in "${parts[@]}"; do
      [ "$(cat "$STASH/VERSION" 2>/dev/null || cat "$d/VERSION")" = "$(cat "$d/VERSION")" ] ||
        { say "$STASH held SGLang $(cat "$STASH/VERSION"): emptied for $(cat "$d/VERSION")"; rm -rf "${STASH:?}"/*; }
      cp -a "$d"/. "$STASH"/
    done
    left=$(missing_in "$STASH")
    if [ "$stash_only" = 1 ]; then
      say "stashed ${parts[*]} in $STASH ($left bundle files still to come); next call within 30 s"
      exit 0
    fi
    [ "$left" = 0 ] || die "$STASH lacks $left files of the bundle: the call with the other --part --stash-only did not run on this machine within 30 s (it was given back); make it again, then this one at once"
    WHEELHOUSE=$STASH
    say "bundle whole in $STASH ($(du -sh "$STASH" | cut -f1))"
  fi
fi
bundle_version=$(cat "$WHEELHOUSE/VERSION" 2>/dev/null || true)
if [ -n "$version" ] && [ -n "$bundle_version" ] && [ "$version" != "$bundle_version" ]; then
  die "--sglang-version $version, but $WHEELHOUSE holds $bundle_version (SGLANG_VERSION=$version scripts/sglang_wheelhouse.sh)"
fi
version=${version:-$bundle_version}

if [ "$dry" = 1 ]; then
  say "plan: sglang ${version:-from the bundle}, tp $tp, site $SITE, results $results"
  [ -z "$cutlass" ] || say "plan: cutlass from $cutlass"
  if [ ${#exec_cmd[@]} -gt 0 ]; then say "plan: exec ${exec_cmd[*]}"; exit 0; fi
  for j in "${jobs[@]}"; do say "plan: job ${j%%=*}: HSQ_LIVE_TP=$tp pytest -m gpu ${j#*=}"; done
  exit 0
fi

installed=$(cat "$SITE/.hsq-installed" 2>/dev/null || true)
if [ -z "$installed" ] || { [ -n "$version" ] && [ "$installed" != "$version" ]; }; then
  [ -d "$WHEELHOUSE/wheels" ] || die "no $WHEELHOUSE/wheels: run scripts/sglang_wheelhouse.sh"
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
  # Redis beside the site dir: a later call (the cutlass one) may come without the bundle.
  mkdir -p "$SITE/.redis" && cp -f "$WHEELHOUSE"/redis/* "$SITE/.redis/" 2>/dev/null || true
  echo "${version:-unknown}" >"$SITE/.hsq-installed"
  say "installed sglang ${version:-?} into $SITE ($(du -sh "$SITE" | cut -f1))"
fi
if [ -n "$cutlass" ]; then
  want=$(tar -xJOf "$cutlass" ./.cutlass-version 2>/dev/null || echo "?")
  if [ "$(cat "$SITE/.cutlass-version" 2>/dev/null || true)" != "$want" ]; then
    tar -xJf "$cutlass" -C "$SITE"
    say "cutlass $want unpacked into $SITE"
  fi
fi

mkdir -p "$CACHE" "$results" "$WORK"
if [ -x "$SITE/.redis/redis-server" ]; then
  export PATH="$SITE/.redis:$PATH" LD_LIBRARY_PATH="$SITE/.redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The cutlass package's .pth is not read from a PYTHONPATH folder: name its folder.
CUTLASS_PATH=""
for d in python_packages dsl_packages; do  # 4.5.x, 4.6.x
  if [ -d "$SITE/nvidia_cutlass_dsl/$d" ]; then CUTLASS_PATH=":$SITE/nvidia_cutlass_dsl/$d"; fi
done
export PYTHONPATH="$PWD:$SITE$CUTLASS_PATH${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
# Multi-GPU hosts here must never use NVLink multicast (it can take shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# tvm-ffi finds CUDA through CUDA_HOME (nvcc may be a wrapper script elsewhere on PATH).
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
    if [ -x "$d/bin/nvcc" ]; then export CUDA_HOME=$d; break; fi
  done
fi
export PATH="${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"
caches() {  # JIT caches (tvm-ffi, triton, flashinfer) under $1
  export TVM_FFI_CACHE_DIR="$1/tvm-ffi" TRITON_CACHE_DIR="$1/triton"
  export FLASHINFER_WORKSPACE_BASE="$1" XDG_CACHE_HOME="$1/xdg"
}
caches "$CACHE"
say "python $("$PY" -c 'import sys, torch, sglang; print(sys.version.split()[0], "torch", torch.__version__, "sglang", sglang.__version__)'), CUDA_HOME=${CUDA_HOME:-unset}"
if [ ${#exec_cmd[@]} -gt 0 ]; then exec "${exec_cmd[@]}"; fi

"$PY" -m tests.gpu.models_fixture "$WORK/models" >"$WORK/models.log" 2>&1 ||
  { tail -30 "$WORK/models.log"; die "writing the test models failed"; }
pids=()
for j in "${jobs[@]}"; do
  name=${j%%=*}
  read -r -a args <<<"${j#*=}"
  jc="$CACHE"
  if [ ${#jobs[@]} -gt 1 ]; then  # parallel jobs: own caches, so no two compile one kernel
    jc="$CACHE-$name"
    [ -d "$jc" ] || cp -a "$CACHE" "$jc"
  fi
  (
    caches "$jc"
    [ -z "$version" ] || export HSQ_LIVE_SGLANG_VERSION=$version
    HSQ_LIVE_WORK="$WORK/$name" HSQ_LIVE_MODELS="$WORK/models" HSQ_LIVE_TP=$tp \
      HSQ_LIVE_RESULTS="$results/live-$name.json" \
      "$PY" -m pytest -p no:cacheprovider -m gpu -o addopts= -rA -v --timeout "$test_timeout" "${args[@]}" \
      >"$WORK/pytest-$name.log" 2>&1
  ) &
  pids+=("$!")
  say "job $name started (pid $!): pytest ${args[*]}"
done
# Progress while the jobs run (a device call shows its output at the end, or its last
# lines when it ends hard): each job's latest [live] line, every TICK seconds.
(
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep "${TICK:-60}" & nap=$!
    wait "$nap"
    for n in "${names[@]}"; do
      line=$(grep -a '\[live\]\|PASSED\|FAILED\|ERROR' "$WORK/pytest-$n.log" 2>/dev/null | tail -1 | cut -c1-200)
      say "$n (${SECONDS} s): ${line:-running}"
    done
  done
) &
ticker=$!
rc=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then say "job ${names[$i]}: passed"; else rc=1; say "job ${names[$i]}: FAILED"; fi
  tail -5 "$WORK/pytest-${names[$i]}.log" | sed "s/^/[${names[$i]}] /"
done
kill "$ticker" 2>/dev/null || true
# A device call brings back 8 files: the results JSONs, one file of every job's pytest
# tail, and one archive of every pytest, server and worker log (outputs and dumps left out).
for n in "${names[@]}"; do echo "=== $n"; tail -60 "$WORK/pytest-$n.log" 2>/dev/null; done >"$results/pytest-tails.txt"
(cd "$WORK" && find "${names[@]}" pytest-*.log models.log -name '*.log' -size -20M -print0 2>/dev/null |
  tar --null -T - -czf "$results/logs.tgz") || true
exit $rc
