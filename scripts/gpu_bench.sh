#!/usr/bin/env bash
# gpu_bench.sh [--prepare | --dry-run | --small]: issue 35's worker benchmarks in one call on
# the GPU machine (16 cores; the GPU itself is not used: null-model servers), results as JSON
# in $OUT. About 200 s in all, each phase bounded (ceiling 150 s, node 75 s).
#
#   here, once:   scripts/gpu_bench.sh --prepare     # fills the ignored .live/ (~12 MB)
#   device call:  run(command="bash scripts/gpu_bench.sh", carry=[".live"], timeout_s=280)
#
# Phases: (1) python -m bench.ceiling, 8B shape, short (64-512) and long (1024-4096) samples,
# bf16 / fp8 quantized by the worker / fp8 made by the server, each with --persist-procs 0
# and 8, then the disk probe (targets: >= 400 samples/s short and >= 0.9 of the disk's best
# on long, bf16); (2) python -m bench.node --null: 8 null servers and 8 workers writing to
# one disk, bf16 and server-made fp8 (target >= 0.9 of the disk's best).
# Writes $OUT/ceiling.json, $OUT/node.json and each phase's log ($OUT/*.log).
#
# .live/ holds what the base image lacks (it has torch, numpy, safetensors, transformers,
# httpx): the bundle's wheels of hsq's other dependencies (from $WH, the SGLang wheelhouse of
# scripts/sglang_wheelhouse.sh), Debian's redis-server with its libraries, and two pure-Python
# packages the bundle has no wheel of (prometheus_client, tqdm), copied from .venv.
# --small: CPU-machine sizes with this checkout's .venv, nothing installed (a rehearsal).
set -euo pipefail
cd "$(dirname "$0")/.."
LIVE=${LIVE:-.live}
WH=${WH:-/work/build/wh-0.5.15}
OUT=${OUT:-$PWD/gpu-bench-out}
SITE=${SITE:-/tmp/hsq-bench-site}
say() { printf '[gpu_bench.sh] %s\n' "$*"; }
die() { say "$*" >&2; exit 2; }
mode=${1:-run}

if [ "$mode" = --prepare ]; then
  [ -d "$WH/wheels" ] || die "no $WH/wheels (WH=... the SGLang wheelhouse)"
  rm -rf "$LIVE" && mkdir -p "$LIVE/wheels" "$LIVE/redis" "$LIVE/site"
  for p in redis hiredis rq structlog xxhash msgspec click croniter python_dateutil; do
    ls "$WH"/wheels/"$p"-*.whl >/dev/null 2>&1 || die "no $p wheel in $WH/wheels"
    cp "$WH"/wheels/"$p"-*.whl "$LIVE/wheels/"
  done
  cp "$WH"/redis/* "$LIVE/redis/"
  for p in prometheus_client tqdm; do
    src=$(ls -d .venv/lib/python3*/site-packages/"$p" 2>/dev/null | head -1)
    [ -n "$src" ] || die "no $p in .venv (make setup)"
    cp -r "$src" "$LIVE/site/"
  done
  find "$LIVE/site" -name __pycache__ -prune -exec rm -rf {} +
  say "prepared $LIVE ($(du -sh "$LIVE" | cut -f1)); carry it: carry=[\"$LIVE\"]"
  exit 0
fi

CEIL=(--shapes 8b --procs 0,8 --short-samples 800 --long-samples 100 --disk-mb 1024
      --out-root "${OUT_DISK:-/root}" --label h200-issue35)
NODE=(--null --workers 8 --shape 8b --workload long --samples-per-worker 12 --inflight 4
      --disk-mb 512 --out-root "${OUT_DISK:-/root}")
T_CEIL=${T_CEIL:-150} T_NODE=${T_NODE:-75}
PY=${PY:-python3}
[ -x /opt/torch/.venv/bin/python3 ] && PY=${PY_OVERRIDE:-/opt/torch/.venv/bin/python3}
if [ "$mode" = --small ]; then
  PY=.venv/bin/python
  CEIL=(--small --procs 0,2 --short-samples 60 --long-samples 6 --disk-mb 64 --label cpu-rehearsal)
  NODE=(--null --workers 2 --shape 8b --workload long --samples-per-worker 3 --inflight 2 --disk-mb 64)
  T_CEIL=600 T_NODE=300
fi
if [ "$mode" = --dry-run ]; then
  say "plan: $PY -m bench.ceiling ${CEIL[*]} --json-out $OUT/ceiling.json (<= ${T_CEIL}s)"
  say "plan: $PY -m bench.node ${NODE[*]} --json-out $OUT/node.json (<= ${T_NODE}s)"
  exit 0
fi
[ "$mode" = run ] || [ "$mode" = --small ] || die "unknown option $mode (see the header of $0)"
mkdir -p "$OUT"

if [ "$mode" = run ]; then
  [ -d "$LIVE/wheels" ] || die "no $LIVE/wheels: run scripts/gpu_bench.sh --prepare here and carry $LIVE"
  rm -rf "$SITE" && mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$SITE" "$LIVE"/wheels/*.whl
  cp -r "$LIVE"/site/* "$SITE/"
  chmod 755 "$LIVE/redis/redis-server"
  export PATH="$PWD/$LIVE/redis:$PATH"
  export LD_LIBRARY_PATH="$PWD/$LIVE/redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
say "python $("$PY" -c 'import sys, torch, hsq; print(sys.version.split()[0], "torch", torch.__version__, "hsq", hsq.__version__)'), $(nproc) cpus, redis $(redis-server --version | cut -d' ' -f3)"
df -h "${OUT_DISK:-/root}" /dev/shm 2>/dev/null | sed 's/^/[gpu_bench.sh] /' || true

t0=$(date +%s)
rc=0
timeout -k 5 "$T_CEIL" "$PY" -m bench.ceiling "${CEIL[@]}" --json-out "$OUT/ceiling.json" \
  >"$OUT/ceiling.log" 2>&1 || rc=$?
say "ceiling: rc $rc after $(( $(date +%s) - t0 )) s"
grep -E "^  |target" "$OUT/ceiling.log" | tail -40 || true
t1=$(date +%s)
rc2=0
timeout -k 5 "$T_NODE" "$PY" -m bench.node "${NODE[@]}" --json-out "$OUT/node.json" \
  >"$OUT/node.log" 2>&1 || rc2=$?
say "node: rc $rc2 after $(( $(date +%s) - t1 )) s"
grep -E "^  |^hsq node" "$OUT/node.log" | tail -10 || true
say "total $(( $(date +%s) - t0 )) s; JSON in $OUT (ceiling.json, node.json; per-run lines in the logs)"
[ "$rc" = 0 ] && [ "$rc2" = 0 ]
