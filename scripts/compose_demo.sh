#!/usr/bin/env bash
# `make compose-demo`: a small generated dataset through the running compose stack (either
# profile): enqueue it, wait until every sample is done or dead, print `hsq status`.
#   REDIS_PASSWORD=... docker compose --profile cpu up -d && make compose-demo
# COMPOSE: the compose command [docker compose, else docker-compose], with -p/-f as the stack
# was started. HSQ_RUN (the run the workers serve) and DATA_DIR as for `up`.
# DEMO_SAMPLES [64], DEMO_TIMEOUT_S [900]. Exits 1 if a sample ended dead or time ran out.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else COMPOSE=docker-compose; fi
fi
run=${HSQ_RUN:-run}
data=${DATA_DIR:-./data}
samples=${DEMO_SAMPLES:-64}
mkdir -p "$data"
data=$(cd "$data" && pwd)

echo "[compose-demo] writing $samples synthetic samples to $data/demo.jsonl"
$COMPOSE run --rm --no-deps -v "$data:/gen" hsq python -c \
  "from pathlib import Path; from hsq.producer.synthetic import write_synthetic as w; w(Path('/gen/demo.jsonl'), $samples, seed=0, min_len=16, max_len=512)"
$COMPOSE run --rm --no-deps hsq hsq enqueue /data/demo.jsonl --run "$run" --out /outputs --no-progress

echo "[compose-demo] waiting for run $run (timeout ${DEMO_TIMEOUT_S:-900}s)"
# One long exec in the exporter's container (it has hsq and the Redis URL): no polling loop
# of container starts.
$COMPOSE exec -T exporter python -c '
import json, subprocess, sys, time
run, timeout = sys.argv[1], float(sys.argv[2])
deadline, last = time.monotonic() + timeout, None
while True:
    out = subprocess.run(["hsq", "status", "--run", run, "--json"], capture_output=True,
                         text=True, check=True).stdout
    s = json.loads(out.strip().splitlines()[-1])
    line = f"done {s['"'"'done'"'"']}/{s['"'"'total'"'"']}, dead {s['"'"'dead'"'"']}"
    if line != last:
        print("[compose-demo]", line, flush=True)
        last = line
    if s["done"] + s["dead"] >= s["total"]:
        sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit("[compose-demo] timed out: see `docker compose logs`")
    time.sleep(2)
' "$run" "${DEMO_TIMEOUT_S:-900}"
$COMPOSE exec -T exporter hsq status --run "$run"
dead=$($COMPOSE exec -T exporter hsq status --run "$run" --json | tail -n 1 |
  $COMPOSE exec -T exporter python -c 'import json,sys; print(json.load(sys.stdin)["dead"])')
[ "$dead" = 0 ] || { echo "[compose-demo] $dead samples in the dead letter" >&2; exit 1; }
