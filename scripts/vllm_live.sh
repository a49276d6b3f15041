#!/usr/bin/env bash
# scripts/vllm_live.sh [OPTIONS]: hsq against stock vLLM 0.26.0 on a GPU machine without a
# registry: install the bundle of scripts/vllm_wheelhouse.sh, then run the phases, each
# writing RESULTS/<phase>.json as it ends (a device call ends hard at its limit, so the
# most important check runs first):
#   one       a small random Llama (8 layers, hidden 512, head_dim 128) served by
#             `hsq launch-vllm` (extract_hidden_states, hsq's connector); one short and one 1500-token prompt (3 chunks of
#             --max-num-batched-tokens 512): each dump, read back by hsq, equals a float32
#             transformers forward within hsq.closeness.rule (aux per layer, post-norm, pre-norm)
#   worker    a run through `hsq worker --engine vllm --inflight K`, stored samples
#             against the same forward, the worker's tokens/s
#   restart   SIGKILL of vLLM's process group while a worker runs; vLLM started again; the
#             run ends with every sample done, none dead
#   capacity  completions/s with the connector dumping, then of plain vLLM (no connector)
#   run       `hsq run --engine vllm --gpus 0` (one command: its own Redis, `hsq launch-vllm`,
#             a worker, the live view, --verify); RESULTS/hsq-run.json: exit, summary,
#             the live view's last lines (dry run: --engine reference, the plumbing only)
#   fp8       server-made fp8 (`hsq launch-vllm --dump-encoding fp8-e4m3 --prenorm`): a run
#             stored as fp8-e4m3 through `hsq worker`, every output against the float32
#             forward quantized the same way (the fp8 rule; 8b: `hsq verify --deep`), and
#             with --shape 8b its capacity at the best K (ratios: connector_fp8_over_plain)
#   moe       a tiny random DeepSeek-V3 (MLA + MoE, tests/gpu/models.py) through `hsq
#             launch-vllm` (TRITON_MLA, the bundle's vllm-moe unit) and a worker; each output
#             against the float32 forward under the MoE rule (tests/gpu/equality.compare_moe:
#             the dense prefix row by row, the rest under hsq's MoE allowance: vLLM does not
#             return its expert choices, so no replay)
#
# --shape 8b: Llama-3-8B's config served with --load-format dummy (no weights to carry; no
# forward can hold its dumps to a reference, so only worker and capacity run, and the
# worker's outputs are checked by `hsq verify --deep`), dumps on /dev/shm:
#   capacity  plain vLLM at each K of --k-list (vLLM's best in-flight count), then the
#             connector dumping at that best K (dumps swept as they complete): the
#             connector's cost = with / plain
#   worker    `hsq worker --inflight <best K>` end to end on the same length mix, its
#             steady tokens/s against the connector's: hsq end to end = worker / with
#             (RESULTS/ratios.json holds both ratios)
#
#   --parts DIR[,DIR]  bundle parts to install (default: .vllm-wheelhouse/part*); units
#                      already installed in SITE are skipped, so a second device call made
#                      within the warm window needs none
#   --phases LIST      comma list of the phases above (default one,worker,restart,capacity)
#   --inflight K       the worker's requests in flight (default 8)
#   --backend NAME     vLLM --attention-backend (default TRITON_ATTN; FLASH_ATTN uses FA3)
#   --shape S          tiny (default) or 8b (see above)
#   --k-list LIST      8b capacity: the in-flight counts tried for plain vLLM (16,64,128)
#   --results DIR      results (default: $OUT if set, else ./live-results)
#   --dry-run          on a CPU: no install, no GPU; the vLLM-shaped stand-in
#                      (tests.support.fakevllm, hsq's connector core over a transformers
#                      forward) takes vLLM's place, with small sizes. Checks the script,
#                      the checks and hsq's side; says nothing about vLLM
# Environment: SITE (/tmp/vllm-site), WORK (/tmp/hsq-vllm-live), PORT (18431),
# START_TIMEOUT (420 s per vLLM start). The image's torch 2.11 cu130, triton, transformers,
# safetensors, httpx and numpy are used as they are; nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SITE=${SITE:-/tmp/vllm-site}
WORK=${WORK:-/tmp/hsq-vllm-live}
PORT=${PORT:-18431}
START_TIMEOUT=${START_TIMEOUT:-420}
say() { printf '[vllm_live.sh] %s (%s s)\n' "$*" "$SECONDS"; }
die() { say "$*" >&2; exit 2; }

parts="" phases="" inflight=8 backend=TRITON_ATTN dry=0 shape=tiny klist=16,64,128
results="${OUT:-$PWD/live-results}"
while [ $# -gt 0 ]; do
  case "$1" in
    --parts) [ $# -ge 2 ] || die "--parts needs a value"; parts=$2; shift 2 ;;
    --phases) [ $# -ge 2 ] || die "--phases needs a value"; phases=$2; shift 2 ;;
    --inflight) [ $# -ge 2 ] || die "--inflight needs a value"; inflight=$2; shift 2 ;;
    --backend) [ $# -ge 2 ] || die "--backend needs a value"; backend=$2; shift 2 ;;
    --shape) [ $# -ge 2 ] || die "--shape needs a value"; shape=$2; shift 2 ;;
    --k-list) [ $# -ge 2 ] || die "--k-list needs a value"; klist=$2; shift 2 ;;
    --results) [ $# -ge 2 ] || die "--results needs a folder"; results=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) die "unknown option $1 (see the header of $0)" ;;
  esac
done
[[ "$inflight" =~ ^[1-9][0-9]*$ ]] || die "--inflight $inflight: expected an integer >= 1"
[[ "$klist" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--k-list $klist: expected integers, a,b,c"
case "$shape" in
  tiny) phases=${phases:-one,worker,restart,capacity} ;;
  8b) phases=${phases:-capacity,worker} ;;
  *) die "--shape $shape: expected tiny or 8b" ;;
esac
for p in ${phases//,/ }; do
  case "$p" in one|worker|restart|capacity|run|moe|fp8) ;; *) die "--phases: unknown phase $p" ;; esac
  if [ "$shape" = 8b ] && { [ "$p" = one ] || [ "$p" = restart ]; }; then
    die "--shape 8b: phase $p compares with a forward of the weights, and dummy weights have none (run it with --shape tiny)"
  fi
done
mkdir -p "$results" "$WORK"
# A device call brings back 8 files: every figure and log is written under WORK/res, and
# after each phase (and at exit) packed into the results dir as summary.json (every JSON,
# by file name) and logs.tgz.
out_dir=$(cd "$results" && pwd)
results=$WORK/res
rm -rf "$results" && mkdir -p "$results"
export RESULTS=$results
pack() {
  "${PY:-python3}" - "$results" "$out_dir/summary.json" <<'EOF' || true
import json, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
data = {}
for p in sorted(src.glob("*.json")):
    try:
        data[p.stem] = json.loads(p.read_text())
    except ValueError as exc:
        data[p.stem] = {"unreadable": str(exc)}
tmp = dst.with_name(dst.name + ".tmp")
tmp.write_text(json.dumps(data, indent=1))
tmp.replace(dst)
EOF
  tar -C "$results" -czf "$out_dir/logs.tgz.tmp" --exclude='*.json' . 2>/dev/null &&
    mv -f "$out_dir/logs.tgz.tmp" "$out_dir/logs.tgz" || true
}
LAYERS=2,4,5   # hsq's convention for the small Llama (L = 8); vLLM is asked for 2,4,5,8
MIN_LEN=16
if [ "$dry" = 1 ]; then
  PY=${PY:-$ROOT/.venv/bin/python}; [ -x "$PY" ] || PY=python3
  N_WORKER=12 N_RESTART=16 N_CAP=16 CAP_K=4 MAX_LEN=300 N_MOE=6
else
  PY=${PY:-python3}
  [ -x /opt/torch/.venv/bin/python3 ] && PY=${PY_OVERRIDE:-/opt/torch/.venv/bin/python3}
  N_WORKER=256 N_RESTART=256 N_CAP=512 CAP_K=64 MAX_LEN=1500 N_MOE=120
fi
if [ "$shape" = 8b ]; then
  LAYERS=2,16,29  # EAGLE-3's 1, L/2-1, L-4 of L = 32, as effective ids
  MIN_LEN=64 MAX_LEN=1963  # the capacity check's mix (64 + i*613 mod 1900)
  [ "$dry" = 1 ] || { N_WORKER=${N_WORKER8:-384} N_CAP=${N_CAP8:-1024}; }
fi
say "plan: shape $shape, phases $phases, inflight $inflight, backend $backend, dry-run $dry, results $results"

# ---------------------------------------------------------------- install (GPU only)
if [ "$dry" = 0 ] && [ -z "$parts" ] && [ ! -d .vllm-wheelhouse ] && [ ! -f "$SITE/.unit-vllm-py" ] &&
  "$PY" -c 'import vllm' 2>/dev/null; then
  # A machine with vLLM installed (tests/gpu/test_vllm_live.py there): used as it is.
  say "vLLM $("$PY" -c 'import vllm; print(vllm.__version__)') installed: no bundle to unpack"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  REDIS_BIN=$(command -v redis-server || true)
elif [ "$dry" = 0 ]; then
  [ -n "$parts" ] || parts=$(ls -d .vllm-wheelhouse/part* 2>/dev/null | paste -sd, || true)
  mkdir -p "$SITE"
  for d in ${parts//,/ }; do
    for u in "$d"/*.tar.xz; do
      [ -f "$u" ] || continue
      name=$(basename "$u" .tar.xz)
      [ -f "$SITE/.unit-$name" ] && continue
      "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2], filter="data")' "$u" "$SITE"
      touch "$SITE/.unit-$name"
      say "installed $name"
    done
  done
  for need in vllm-py vllm-c vllm-fa3 deps hsq; do
    [ -f "$SITE/.unit-$need" ] || die "unit $need is not in $SITE: pass --parts with the part holding it"
  done
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  # The bundle carries no flashinfer: vLLM falls back to its native top-k/top-p sampler.
  export VLLM_USE_FLASHINFER_SAMPLER=0
  export VLLM_CACHE_ROOT=/tmp/vllm-cache TRITON_CACHE_DIR=/tmp/vllm-cache/triton XDG_CACHE_HOME=/tmp/vllm-cache/xdg
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
  REDIS_BIN=$SITE/.redis-bin/redis-server
  export LD_LIBRARY_PATH="$SITE/.redis-bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  REDIS_BIN=$(command -v redis-server || true)
fi
export PYTHONUNBUFFERED=1
CHECK=("$PY" "$ROOT/scripts/vllm_live_check.py")
HSQ=("$PY" -m hsq)

DUMPS=$WORK/dumps
if [ "$shape" = 8b ] && [ "$dry" = 1 ]; then
  # The stand-in runs a transformers forward on this CPU: the tiny model takes the 8B's
  # place (the dry run checks the script's 8b path and hsq's side, not the shape).
  MODEL=$WORK/llama-8x512 LAYERS=2,4,5
  [ -f "$MODEL/config.json" ] || "${CHECK[@]}" tiny "$MODEL"
  DUMPS=/dev/shm/hsq-vllm-live-dumps-dry
  SWEEP=(--sweep "$DUMPS")
  VLLM_ARGS=()
elif [ "$shape" = 8b ]; then
  MODEL=$WORK/llama-8b-config
  [ -f "$MODEL/config.json" ] || "${CHECK[@]}" config8b "$MODEL"
  [ -d /dev/shm ] && [ -w /dev/shm ] && DUMPS=/dev/shm/hsq-vllm-live-dumps
  SWEEP=(--sweep "$DUMPS")
  VLLM_ARGS=(--dtype bfloat16 --max-model-len 8192 --skip-tokenizer-init --enforce-eager
    --attention-backend "$backend" --gpu-memory-utilization 0.85 --max-num-batched-tokens 8192
    --max-num-seqs 256 --generation-config vllm --load-format dummy)
else
  MODEL=$WORK/llama-8x512
  [ -f "$MODEL/config.json" ] || "${CHECK[@]}" tiny "$MODEL"
  SWEEP=()
  VLLM_ARGS=(--dtype bfloat16 --max-model-len 4096 --skip-tokenizer-init --enforce-eager
    --attention-backend "$backend" --gpu-memory-utilization 0.30 --max-num-batched-tokens 512
    --max-num-seqs 64 --generation-config vllm)
fi
URL=http://127.0.0.1:$PORT
SRV=""

ENC=()  # the fp8 phase: --dump-encoding fp8-e4m3
start_server() {  # start_server hsq|plain LOG
  mkdir -p "$DUMPS"
  if [ "$dry" = 1 ]; then
    setsid "$PY" -m tests.support.fakevllm --model "$MODEL" --dump-dir "$DUMPS" --port "$PORT" \
      --layers "$LAYERS" --prenorm "${ENC[@]}" >"$results/$2" 2>&1 &
  elif [ "$1" = hsq ]; then
    setsid "${HSQ[@]}" launch-vllm --model-path "$MODEL" --dump-dir "$DUMPS" --port "$PORT" \
      --layers "$LAYERS" --prenorm "${ENC[@]}" --python "$PY" "${VLLM_ARGS[@]}" >"$results/$2" 2>&1 &
  else
    setsid "$PY" -m vllm.entrypoints.cli.main serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
      --no-enable-prefix-caching --enable-prompt-tokens-details "${VLLM_ARGS[@]}" >"$results/$2" 2>&1 &
  fi
  SRV=$!
  local t0=$SECONDS
  until "$PY" -c "import httpx,sys; sys.exit(httpx.get('$URL/health', timeout=2).status_code != 200)" 2>/dev/null; do
    kill -0 "$SRV" 2>/dev/null || { tail -30 "$results/$2"; die "server exited while starting ($2)"; }
    (( SECONDS - t0 < START_TIMEOUT )) || { tail -30 "$results/$2"; die "server not healthy after $START_TIMEOUT s"; }
    sleep 1
  done
  say "server $1 up in $(( SECONDS - t0 )) s ($2)"
  echo "{\"server\": \"$1\", \"start_s\": $(( SECONDS - t0 ))}" > "$results/start-$2.json"
}
stop_server() {  # its own process group (setsid): the API server and vLLM's engine core
  [ -n "$SRV" ] || return 0
  kill -"${1:-TERM}" -- "-$SRV" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$SRV" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SRV" 2>/dev/null || true
  wait "$SRV" 2>/dev/null || true
  SRV=""
}
REDIS_PID=""
cleanup() { stop_server; [ -z "$REDIS_PID" ] || kill "$REDIS_PID" 2>/dev/null || true; pack; }
trap cleanup EXIT

start_redis() {
  [ -n "$REDIS_PID" ] && return 0
  [ -x "$REDIS_BIN" ] || die "no redis-server (the bundle's hsq unit carries one)"
  RPORT=$(( PORT + 1 ))
  "$REDIS_BIN" --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" >"$results/redis.log" 2>&1 &
  REDIS_PID=$!
  export HSQ_REDIS_URL=redis://127.0.0.1:$RPORT/0
  until "$PY" -c "import redis; redis.Redis.from_url('$HSQ_REDIS_URL').ping()" 2>/dev/null; do sleep 0.2; done
}
dataset() {  # dataset FILE N
  "$PY" -c "from hsq.producer.synthetic import write_synthetic as w; from pathlib import Path; import sys; w(Path(sys.argv[1]), int(sys.argv[2]), seed=7, min_len=$MIN_LEN, max_len=$MAX_LEN, vocab=1000)" "$1" "$2"
}
enqueue() {  # enqueue RUN DATA [FLAGS]
  "${HSQ[@]}" enqueue "$2" --run "$1" --out "$WORK/out" --layers "$LAYERS" --prenorm --no-progress "${@:3}"
}
done_count() {
  "$PY" -c "from hsq.runstore import RunStore; from hsq.store import connect; import sys; s = RunStore(connect(sys.argv[1]), sys.argv[2]); print(s.count(s.keys.done))" "$HSQ_REDIS_URL" "$1"
}

for phase in ${phases//,/ }; do
  case "$phase" in
    one)
      [ -n "$SRV" ] || start_server hsq vllm-hsq.log
      "${CHECK[@]}" one "$URL" "$DUMPS" "$MODEL" "$LAYERS" || say "one: MISMATCH (see $results/one.json)"
      ;;
    worker)
      [ -n "$SRV" ] || start_server hsq vllm-hsq.log
      start_redis
      dataset "$WORK/w.jsonl" "$N_WORKER"
      rm -rf "$WORK/out/w"; enqueue w "$WORK/w.jsonl"
      k=${BEST_K:-$inflight}  # 8b: vLLM's best in-flight count, when capacity ran first
      t0=$SECONDS
      "${HSQ[@]}" --log-format json worker --run w --server "$URL" --dump-dir "$DUMPS" --engine vllm \
        --inflight "$k" --burst 2>"$results/worker-w.log" || say "worker: exit $?"
      echo "{\"samples\": $N_WORKER, \"inflight\": $k, \"seconds\": $(( SECONDS - t0 ))}" > "$results/worker-time.json"
      if [ "$shape" = 8b ]; then  # dummy weights: no forward to compare with
        "${CHECK[@]}" rate "$results/worker-w.log" worker || say "worker: no steady rate"
        "${HSQ[@]}" verify --run w --deep --no-progress >"$results/verify-w.log" 2>&1 && v=0 || v=$?
        echo "{\"verify_deep_exit\": $v, \"done\": $(done_count w), \"samples\": $N_WORKER}" > "$results/verify-w.json"
        "${CHECK[@]}" ratios || true
      else
        "${CHECK[@]}" outputs "$HSQ_REDIS_URL" w "$WORK/out" "$MODEL" "$WORK/w.jsonl" "$LAYERS" 8 || say "worker: outputs MISMATCH"
      fi
      ;;
    restart)
      [ -n "$SRV" ] || start_server hsq vllm-hsq.log
      start_redis
      dataset "$WORK/r.jsonl" "$N_RESTART"
      rm -rf "$WORK/out/r"; enqueue r "$WORK/r.jsonl"
      "${HSQ[@]}" --log-format json worker --run r --server "$URL" --dump-dir "$DUMPS" --engine vllm \
        --inflight "$inflight" --burst 2>"$results/worker-r.log" &
      WPID=$!
      # The first sample done (grep of the worker's log: no Python start per look), then
      # SIGKILL of the server's whole process group, mid-run.
      until grep -q '"sample_done"' "$results/worker-r.log" 2>/dev/null; do
        kill -0 "$WPID" 2>/dev/null || break
        sleep 0.1
      done
      stop_server KILL
      at_kill=$(done_count r)
      say "restart: killed the server with SIGKILL at $at_kill of $N_RESTART done"
      start_server hsq vllm-hsq-restarted.log
      wait "$WPID" && rc=0 || rc=$?
      echo "{\"worker_exit\": $rc, \"done_at_kill\": $at_kill, \"samples\": $N_RESTART, \"killed_mid_run\": $([ "$at_kill" -lt "$N_RESTART" ] && echo true || echo false)}" > "$results/restart-worker.json"
      "${CHECK[@]}" outputs "$HSQ_REDIS_URL" r "$WORK/out" "$MODEL" "$WORK/r.jsonl" "$LAYERS" 4 || say "restart: outputs MISMATCH"
      ;;
    capacity)
      if [ "$shape" = 8b ]; then  # plain vLLM's best K first, then the connector at that K
        stop_server
        start_server plain vllm-plain.log
        labels=()
        for k in ${klist//,/ }; do
          "${CHECK[@]}" capacity "$URL" "$N_CAP" "$k" "plain-k$k"
          labels+=("plain-k$k")
        done
        BEST_K=$("${CHECK[@]}" best "${labels[@]}" | tail -1)
        say "capacity: plain vLLM fastest at $BEST_K in flight"
        stop_server
        start_server hsq vllm-hsq.log
        "${CHECK[@]}" capacity "$URL" "$N_CAP" "$BEST_K" connector --rid "${SWEEP[@]}"
        "${CHECK[@]}" ratios || true
        pack
        continue  # the hsq server stays up for the worker phase
      fi
      [ -n "$SRV" ] || start_server hsq vllm-hsq.log
      "${CHECK[@]}" capacity "$URL" "$N_CAP" "$CAP_K" with-connector --rid
      stop_server
      start_server plain vllm-plain.log
      "${CHECK[@]}" capacity "$URL" "$N_CAP" "$CAP_K" plain
      stop_server
      ;;
    run)
      stop_server  # hsq run starts its own server on the GPU
      dataset "$WORK/vrun.jsonl" "$N_WORKER"
      rm -rf "$WORK/vrun-out"
      engine=(--engine vllm --gpus 0 --model "$MODEL")
      [ "$dry" = 0 ] || engine=(--engine reference)
      t0=$SECONDS
      "${HSQ[@]}" --log-format json run "$WORK/vrun.jsonl" --run vrun --out "$WORK/vrun-out" \
        "${engine[@]}" --json --verify --inflight "$inflight" -- --layers "$LAYERS" \
        $([ "$dry" = 1 ] || printf '%s\n' "${VLLM_ARGS[@]}") \
        >"$results/hsq-run.stdout" 2>"$results/hsq-run.stderr" && rc=0 || rc=$?
      "$PY" - "$results" "$rc" "$(( SECONDS - t0 ))" <<'EOF'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
lines = (res / "hsq-run.stdout").read_text(errors="replace").splitlines()
objs = [x for x in lines if x.startswith("{")]
summary = json.loads(objs[-1]) if objs else {}
view = [x for x in lines if x.startswith("progress")]
out = {"exit": int(sys.argv[2]), "seconds": int(sys.argv[3]), "summary": summary,
       "view_first": view[:3], "view_last": view[-3:]}
(res / "hsq-run.json").write_text(json.dumps(out, indent=1))
print("[vllm_live.sh] hsq run:", json.dumps({k: out[k] for k in ("exit", "seconds")}),
      json.dumps(summary.get("verified")), flush=True)
EOF
      for f in "$WORK"/vrun-out/.hsq/logs/*.log; do [ -f "$f" ] && cp "$f" "$results/hsq-run-$(basename "$f")"; done
      ;;
    fp8)
      stop_server
      ENC=(--dump-encoding fp8-e4m3)
      start_server hsq vllm-hsq-fp8.log
      if [ "$shape" = 8b ]; then
        "${CHECK[@]}" capacity "$URL" "$N_CAP" "${BEST_K:-$CAP_K}" connector-fp8 --rid "${SWEEP[@]}"
        "${CHECK[@]}" ratios || true
      fi
      start_redis
      dataset "$WORK/f.jsonl" "$N_WORKER"
      rm -rf "$WORK/out/f"; enqueue f "$WORK/f.jsonl" --store-dtype fp8-e4m3
      "${HSQ[@]}" --log-format json worker --run f --server "$URL" --dump-dir "$DUMPS" --engine vllm \
        --inflight "${BEST_K:-$inflight}" --burst 2>"$results/worker-f.log" || say "fp8: worker exit $?"
      if [ "$shape" = 8b ]; then
        "${HSQ[@]}" verify --run f --deep --no-progress >"$results/verify-f.log" 2>&1 && v=0 || v=$?
        echo "{\"verify_deep_exit\": $v, \"done\": $(done_count f), \"samples\": $N_WORKER}" > "$results/verify-f.json"
      else
        "${CHECK[@]}" fp8 "$HSQ_REDIS_URL" f "$WORK/out" "$MODEL" "$WORK/f.jsonl" "$LAYERS" || say "fp8: outputs outside the fp8 rule"
      fi
      stop_server
      ENC=()
      ;;
    moe)
      stop_server
      MOE=$WORK/deepseek
      "$PY" -c "from tests.gpu.models import write_deepseek as w; from pathlib import Path; import sys; w(Path(sys.argv[1]), seed=0, device=sys.argv[2])" \
        "$MOE" "$([ "$dry" = 1 ] && echo cpu || echo cuda)"
      saved=("${VLLM_ARGS[@]}") model_saved=$MODEL layers_saved=$LAYERS
      MODEL=$MOE LAYERS=2,3,5  # L = 6, layers 0-1 dense: aux id 2 sees no routing
      [ "$dry" = 1 ] || VLLM_ARGS=(--dtype bfloat16 --max-model-len 4096 --skip-tokenizer-init
        --enforce-eager --attention-backend TRITON_MLA --gpu-memory-utilization 0.30
        --max-num-batched-tokens 512 --max-num-seqs 64 --generation-config vllm)
      [ -f "$SITE/.unit-vllm-moe" ] || [ "$dry" = 1 ] || say "moe: no vllm-moe unit in $SITE (pass --parts with part2): vLLM may fail to load the experts"
      start_server hsq vllm-moe.log
      start_redis
      dataset "$WORK/m.jsonl" "$N_MOE"
      rm -rf "$WORK/out/m"; enqueue m "$WORK/m.jsonl"
      "${HSQ[@]}" --log-format json worker --run m --server "$URL" --dump-dir "$DUMPS" --engine vllm \
        --inflight "$inflight" --burst 2>"$results/worker-m.log" || say "moe: worker exit $?"
      "${CHECK[@]}" moe "$HSQ_REDIS_URL" m "$WORK/out" "$MODEL" "$WORK/m.jsonl" "$LAYERS" 2 || say "moe: outputs outside the MoE rule"
      stop_server
      VLLM_ARGS=("${saved[@]}") MODEL=$model_saved LAYERS=$layers_saved
      ;;
  esac
  pack
done
say "done: $(ls "$results" | tr '\n' ' ')"
