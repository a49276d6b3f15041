#!/usr/bin/env bash
# `make lower-bounds`: every direct dependency at the oldest version pyproject.toml allows
# (`name>=X` installed as `name==X`; pip picks the newest of what those need), in a fresh
# venv, then the tests that exercise each of them. docs/packaging.md records the last run.
#   TORCH_SPEC  torch for that venv. Default: the floor in pyproject.toml. On x86_64 PyPI
#               serves old torch only as a CUDA build (~2.5 GB to download, ~5 GB installed);
#               TORCH_SPEC=torch==2.13.0 takes this machine's local CPU wheel instead.
#   VENV        where (default .venv-lowest; removed first). PYTHON: the interpreter.
#   PYTEST_ARGS extra pytest arguments, e.g. a narrower file list.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-lowest}
say() { printf '[lower-bounds] %s\n' "$*"; }

floors=$("$PY" - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# The base and the extras of the roles the tests run (each name once; `all` repeats them,
# dev is the tools, speculators' datasets is tested at CI's version only).
deps, names = [], set()
for group in (project["dependencies"], *(v for k, v in project["optional-dependencies"].items()
                                         if k not in ("all", "dev", "speculators"))):
    for dep in group:
        name = re.split(r"[<>=\[]", dep, maxsplit=1)[0]
        if name not in names:
            names.add(name)
            deps.append(dep)
for dep in deps:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+(?:\[[^\]]*\])?)>=([0-9][0-9.]*)(,.*)?", dep.replace(" ", ""))
    if not m:
        raise SystemExit(f"no lower bound in {dep!r}: every dependency needs one")
    print(f"{m.group(1)}=={m.group(2)}")
EOF
)
torch_floor=$(grep '^torch==' <<<"$floors")
TORCH_SPEC=${TORCH_SPEC:-$torch_floor}
floors=$(grep -v '^torch==' <<<"$floors")

rm -rf "$VENV"
"$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
say "installing $TORCH_SPEC"
"${pip[@]}" install -q "$TORCH_SPEC"
say "installing the floors: $(tr '\n' ' ' <<<"$floors")"
# shellcheck disable=SC2086  # one requirement per word
"${pip[@]}" install -q "$TORCH_SPEC" $floors
# hsq itself without dependencies (they are the floors above), and the test tools.
"${pip[@]}" install -q --no-deps -e .
"${pip[@]}" install -q "$TORCH_SPEC" $floors pytest pytest-timeout psutil pyyaml
say "installed:"
"${pip[@]}" list --format=freeze | grep -iE "^(torch|safetensors|transformers|tokenizers|redis|hiredis|rq|httpx|prometheus.client|click|structlog|tqdm|huggingface.hub|numpy)=="
"${pip[@]}" check || true  # shows conflicts between the floors, if any; the tests decide

# The tests that exercise each dependency: safetensors and torch (protocol, stfile, outputs,
# fp8), redis and rq (queue, store, recover, operations), httpx and the reference server's
# transformers model (reference server, in-process worker), click (settings, project),
# prometheus-client (monitoring), tokenizers (tokenize through the toy tokenizer).
set -x
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_protocol.py tests/test_stfile.py tests/test_outputs.py tests/test_fp8.py \
  tests/test_queue.py tests/test_store_reliability.py tests/test_recover.py \
  tests/test_operations.py tests/test_reference_server.py tests/test_worker_inprocess.py \
  tests/test_worker_unit.py tests/test_settings.py tests/test_monitoring.py \
  tests/test_public_api.py tests/test_chat.py ${PYTEST_ARGS:-}
