#!/usr/bin/env bash
# gpu_bench.sh [--prepare | --dry-run | --small | PLAN]: issue 35's worker benchmarks on the
# GPU machine (16 cores; the GPU itself is not used: null-model servers), results as JSON in
# $OUT. Each phase is bounded by `timeout`.
#
#   here, once:   scripts/gpu_bench.sh --prepare     # fills the ignored .live/ (~20 MB)
#   device call:  run(command="bash scripts/gpu_bench.sh bf16", carry=[".live"], timeout_s=600)
#
# Plans (one device call each, ~300 s):
#   run (default)  the first round's: bench.ceiling (8B, short and long, bf16 / fp8 by the
#                  worker / fp8 by the server, --persist-procs 0 and 8, disk probe), then
#                  bench.node --null (8 null servers and 8 workers, bf16 and server fp8).
#   bf16           the worker's ceiling, bf16: short samples with the outputs on tmpfs (the
#                  worker's own limit: 400 short samples/s of the 8B shape are 3.8 GB/s, past
#                  any one disk here), K 16 / 32 / 64, one run sampled by py-spy (GIL holders),
#                  short on the disk, long on the disk with --persist-procs 0 and 8, and the
#                  disk's best durable rate in the same run (targets: >= 400 samples/s short,
#                  >= 0.9 of the disk's best on long).
#   ceil5          the fifth round's ceiling: short on tmpfs at K 32 / 64 (8 persist threads,
#                  then 16 with 8 and 12 processes), K 64 profiled (py-spy, GIL holders, not
#                  pausing the worker), long on the disk with the disk probe.
#   node5          the node with 60 long samples a worker (windows of ~30 s), bf16 and
#                  server fp8, then fp8 by the worker and by the server on short samples.
#   fp8node        fp8 by the worker and by the server (short on tmpfs, long on the disk, 8
#                  persist processes), then a node: 8 null servers and 8 workers on one disk,
#                  bf16 and server fp8, with the disk probe (target >= 0.9 of the disk's best).
#   stream         train while extracting (bench/stream.py --preset host, < 4 min): delivery
#                  from a full spool (one reader, 4 DataLoader workers) against one worker's
#                  own rate, `hsq run` with and without a stream and a trainer that keeps up,
#                  Redis commands per sample and per item (targets: >= 10x, >= 0.97).
# Writes $OUT/<phase>.json and each phase's log ($OUT/<phase>.log).
#
# .live/ holds what the base image lacks (it has torch, numpy, safetensors, transformers,
# httpx): the bundle's wheels of hsq's other dependencies (from $WH, the SGLang wheelhouse of
# scripts/sglang_wheelhouse.sh), Debian's redis-server with its libraries, two pure-Python
# packages the bundle has no wheel of (prometheus_client, tqdm), copied from .venv, and
# py-spy (a static binary) when .venv has it.
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
dry=0
if [ "$mode" = --dry-run ]; then dry=1; mode=${2:-run}; fi

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
  if [ -x .venv/bin/py-spy ]; then mkdir -p "$LIVE/bin" && cp .venv/bin/py-spy "$LIVE/bin/"; fi
  say "prepared $LIVE ($(du -sh "$LIVE" | cut -f1)); carry it: carry=[\"$LIVE\"]"
  exit 0
fi

DISK=${OUT_DISK:-/root}
SHM=${OUT_SHM:-/dev/shm}
C8=(--shapes 8b --persist-threads 8)
# Each phase: NAME SECONDS ARGS... (a python -m module and its arguments).
PHASES=()
phase() { PHASES+=("$*"); }
case "$mode" in
  run)
    phase ceiling 150 bench.ceiling "${C8[@]}" --procs 0,8 --short-samples 800 --long-samples 100 \
      --disk-mb 1024 --out-root "$DISK" --label h200-issue35
    phase node 75 bench.node --null --workers 8 --shape 8b --workload long \
      --samples-per-worker 12 --inflight 4 --disk-mb 512 --out-root "$DISK" ;;
  bf16)
    phase short-shm 110 bench.ceiling "${C8[@]}" --workloads short --dtypes bf16 --procs 0,8 \
      --short-samples 4000 --short-inflight 32 --disk-mb 0 --out-root "$SHM" --label short-tmpfs-k32
    phase short-shm-k16 40 bench.ceiling "${C8[@]}" --workloads short --dtypes bf16 --procs 8 \
      --short-samples 3000 --short-inflight 16 --disk-mb 0 --out-root "$SHM" --label short-tmpfs-k16
    phase short-shm-k64 40 bench.ceiling "${C8[@]}" --workloads short --dtypes bf16 --procs 8 \
      --short-samples 3000 --short-inflight 64 --disk-mb 0 --out-root "$SHM" --label short-tmpfs-k64
    phase short-prof 40 bench.ceiling "${C8[@]}" --workloads short --dtypes bf16 --procs 8 \
      --short-samples 2000 --short-inflight 32 --disk-mb 0 --out-root "$SHM" \
      --profile "$OUT/prof" --label short-tmpfs-profiled
    phase disk 150 bench.ceiling "${C8[@]}" --dtypes bf16 --procs 0,8 --short-samples 1000 \
      --short-inflight 32 --long-samples 150 --long-inflight 8 --disk-mb 2048 \
      --out-root "$DISK" --label disk ;;
  fp8node)
    phase fp8-short 70 bench.ceiling "${C8[@]}" --workloads short --dtypes fp8-e4m3,fp8-server \
      --procs 8 --short-samples 3000 --short-inflight 32 --disk-mb 0 --out-root "$SHM" \
      --label fp8-short-tmpfs
    phase fp8-long 70 bench.ceiling "${C8[@]}" --workloads long --dtypes fp8-e4m3,fp8-server \
      --procs 8 --long-samples 200 --long-inflight 8 --disk-mb 0 --out-root "$DISK" \
      --label fp8-long-disk
    phase node 150 bench.node --null --workers 8 --shape 8b --workload long \
      --samples-per-worker 20 --inflight 4 --disk-mb 2048 --out-root "$DISK"
    phase short-prof 80 bench.ceiling "${C8[@]}" --workloads short --dtypes bf16 --procs 8 \
      --short-samples 1500 --short-inflight 32 --disk-mb 0 --out-root "$SHM" \
      --profile "$OUT/prof" --label short-tmpfs-profiled ;;
  ceil5)
    phase short-k32 45 bench.ceiling "${C8[@]}" --workloads short --dtypes bf16 --procs 8 \
      --short-samples 4000 --short-inflight 32 --disk-mb 0 --out-root "$SHM" --label short-tmpfs-k32
    phase short-k64 45 bench.ceiling "${C8[@]}" --workloads short --dtypes bf16 --procs 8 \
      --short-samples 5000 --short-inflight 64 --disk-mb 0 --out-root "$SHM" --label short-tmpfs-k64
    phase short-k64-t16 70 bench.ceiling --shapes 8b --persist-threads 16 --workloads short \
      --dtypes bf16 --procs 8,12 --short-samples 5000 --short-inflight 64 --disk-mb 0 \
      --out-root "$SHM" --label short-tmpfs-k64-t16
    phase short-prof 45 bench.ceiling "${C8[@]}" --workloads short --dtypes bf16 --procs 8 \
      --short-samples 4000 --short-inflight 64 --disk-mb 0 --out-root "$SHM" \
      --profile "$OUT/prof" --label short-tmpfs-profiled
    phase long-disk 150 bench.ceiling "${C8[@]}" --workloads long --dtypes bf16 --procs 0,8 \
      --long-samples 200 --long-inflight 8 --disk-mb 2048 --out-root "$DISK" --label long-disk ;;
  node5)
    phase node 330 bench.node --null --workers 8 --shape 8b --workload long \
      --samples-per-worker 60 --inflight 4 --disk-mb 2048 --out-root "$DISK"
    phase fp8-short 70 bench.ceiling "${C8[@]}" --workloads short --dtypes fp8-e4m3,fp8-server \
      --procs 8 --short-samples 4000 --short-inflight 64 --disk-mb 0 --out-root "$SHM" \
      --label fp8-short-tmpfs ;;
  stream)
    phase stream 280 bench.stream --preset host ;;
  --small)
    PY=.venv/bin/python
    phase ceiling 600 bench.ceiling --small --procs 0,2 --short-samples 60 --long-samples 6 \
      --disk-mb 64 --label cpu-rehearsal
    phase node 300 bench.node --null --workers 2 --shape 8b --workload long \
      --samples-per-worker 3 --inflight 2 --disk-mb 64 ;;
  *) die "unknown option or plan $mode (see the header of $0)" ;;
esac
PY=${PY:-python3}
if [ "$mode" != --small ] && [ -x /opt/torch/.venv/bin/python3 ]; then
  PY=${PY_OVERRIDE:-/opt/torch/.venv/bin/python3}
fi
if [ "$dry" = 1 ]; then
  for ph in "${PHASES[@]}"; do
    read -r name secs mod args <<<"$ph"
    say "plan $mode: $name (<= ${secs}s): $PY -m $mod $args --json-out $OUT/$name.json"
  done
  exit 0
fi
mkdir -p "$OUT"

if [ "$mode" != --small ] && [ -z "${NO_INSTALL:-}" ]; then  # NO_INSTALL=1: a rehearsal here
  [ -d "$LIVE/wheels" ] || die "no $LIVE/wheels: run scripts/gpu_bench.sh --prepare here and carry $LIVE"
  rm -rf "$SITE" && mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$SITE" "$LIVE"/wheels/*.whl
  cp -r "$LIVE"/site/* "$SITE/"
  chmod 755 "$LIVE/redis/redis-server"
  export PATH="$PWD/$LIVE/redis:$PATH"
  export LD_LIBRARY_PATH="$PWD/$LIVE/redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if [ -x "$LIVE/bin/py-spy" ] || [ -f "$LIVE/bin/py-spy" ]; then
    chmod 755 "$LIVE/bin/py-spy"
    export PATH="$PWD/$LIVE/bin:$PATH"
  fi
fi
export PYTHONUNBUFFERED=1 HSQ_PROFILE_GIL=${HSQ_PROFILE_GIL:-1} HSQ_PROFILE_RATE=${HSQ_PROFILE_RATE:-100}
say "python $("$PY" -c 'import sys, torch, hsq; print(sys.version.split()[0], "torch", torch.__version__, "hsq", hsq.__version__)'), $(nproc) cpus, redis $(redis-server --version | cut -d' ' -f3), plan $mode"
df -h "$DISK" "$SHM" 2>/dev/null | sed 's/^/[gpu_bench.sh] /' || true

t0=$(date +%s)
failed=0
for ph in "${PHASES[@]}"; do
  read -r -a words <<<"$ph"
  name=${words[0]} secs=${words[1]} mod=${words[2]}
  t1=$(date +%s)
  rc=0
  timeout -k 5 "$secs" "$PY" -m "$mod" "${words[@]:3}" --json-out "$OUT/$name.json" \
    >"$OUT/$name.log" 2>&1 || rc=$?
  say "$name: rc $rc after $(( $(date +%s) - t1 )) s"
  grep -E "^  |target|^hsq node" "$OUT/$name.log" | tail -30 || true
  [ "$rc" = 0 ] || failed=$((failed + 1))
done
# The transfer back carries a handful of files: profiles go as one archive.
if [ -d "$OUT/prof" ]; then
  tar -C "$OUT" -czf "$OUT/prof.tar.gz" prof && rm -rf "$OUT/prof"
fi
say "total $(( $(date +%s) - t0 )) s, $failed phase(s) failed; JSON and logs in $OUT"
[ "$failed" = 0 ]
