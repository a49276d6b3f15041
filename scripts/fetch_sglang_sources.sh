#!/usr/bin/env bash
# Downloads the wheel of every SGLang version the dump hook pins (the list lives in
# hsq/engines/sglang/compat.py) into .cache/sglang/, for
# tests/test_sglang_conformance.py, which reads their source as files. Nothing is
# installed. The same wheel is picked on every host (CPython 3.11, manylinux x86_64).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
[ -x "$PY" ] || PY=${PYTHON:-python3}
dest=.cache/sglang
mkdir -p "$dest"
# Fetched third-party code must never be committed, whatever .gitignore says.
[ -f .cache/.gitignore ] || echo '*' >.cache/.gitignore

versions=$("$PY" -c 'from hsq.engines.sglang.compat import PINNED_VERSIONS; print(*PINNED_VERSIONS)')
for v in $versions; do
  if compgen -G "$dest/sglang-$v-*.whl" >/dev/null; then
    continue
  fi
  echo "[fetch_sglang_sources] sglang==$v"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version 3.11 --platform manylinux_2_34_x86_64 \
    "sglang==$v" -d "$dest"
done
