# hsq developer entry points. `make setup` first; everything else uses .venv/.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: dist constraints lower-bounds
.PHONY: setup test test-fresh test-slow lint fmt clean demo bench bench-smoke sglang-sources pip-check
.PHONY: setup-deploy compose-test slurm-test compose-demo

setup:
	./scripts/setup.sh

# No unmet or conflicting requirement in .venv (setup.sh ends with it too; CI runs it).
# SpecForge and speculators are not in .venv: docs/training.md, "Where each trainer lives".
pip-check:
	$(PY) -m pip check

# Two processes, each taking whole test files (module-scoped servers stay in one process).
# hsq's bytecode first: the suite starts `hsq` hundreds of times, and where
# PYTHONDONTWRITEBYTECODE is set none of them would write it, each compiling every module
# it imports again (compileall writes it regardless; a stale file is simply recompiled).
test:
	$(PY) -m compileall -q hsq > /dev/null
	$(PY) -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

# The real-process tier (tests marked realproc: signals, kills, os._exit, starts, readiness)
# once more with every server, worker and `hsq` process a fresh exec instead of a fork of
# the test zygote, so a behaviour only a fork has cannot hide a bug. CI runs it once.
test-fresh:
	HSQ_TEST_SPAWNER=fresh $(PY) -m pytest -m realproc -n 2 --dist loadfile $(PYTEST_ARGS)

# The end-to-end checks that take minutes each, kept out of `make test` so the suite stays
# under ten minutes: the built wheel in a fresh venv, SpecForge's own trainer learning from
# an hsq export, and SpecForge's EAGLE-3 learning from hsq's stream
# (examples/train_eagle3_from_stream.py, killed once and resumed). CI runs them (.ci/run).
test-slow:
	$(PY) -m pytest -m "package or trainer" $(PYTEST_ARGS)

demo:
	$(VENV)/bin/hsq demo

# Benchmarks run as modules from the repository root, so `bench.*` imports resolve in a
# fresh clone (bench/ is not installed). BENCHMARKS.md has the figures and GPU commands.
bench:
	$(PY) -m bench.pipeline
	$(PY) -m bench.ceiling --small
	$(PY) -m bench.scale --preset ci
	$(PY) -m bench.stream

# Seconds, no figures asserted: CI runs it so the benchmarks cannot rot unnoticed.
bench-smoke:
	$(PY) -m bench.ceiling --smoke
	$(PY) -m bench.stream --smoke
	$(PY) -m bench.pipeline --samples 6 --min-len 16 --max-len 64 --capacity-inflight 2 \
		--disk-mb 64

sglang-sources:
	./scripts/fetch_sglang_sources.sh

# The release artifacts (docs/packaging.md): the sdist, the wheel built from it, both checked.
# The images install this wheel, so the targets that build images depend on it.
dist:
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

# constraints.txt from .venv: the versions CI installs (scripts/constraints.sh says more).
constraints:
	./scripts/constraints.sh

# The oldest dependency versions pyproject.toml allows, in .venv-lowest, and the tests
# that exercise them (downloads a CUDA torch unless TORCH_SPEC says otherwise).
lower-bounds:
	./scripts/lower_bounds.sh

# Deployment, started for real (docs/deploy.md). The tests need root; setup-deploy installs
# docker.io, docker-compose, debootstrap, slurm-wlm and munge from Debian when missing.
DEPLOY_PYTEST := $(PY) -m pytest -p no:cacheprovider

setup-deploy:
	./scripts/setup_deploy.sh

compose-test: setup-deploy dist
	$(DEPLOY_PYTEST) deploy/tests/test_compose.py $(PYTEST_ARGS)

slurm-test: setup-deploy
	$(DEPLOY_PYTEST) deploy/tests/test_slurm.py $(PYTEST_ARGS)

# A small generated run through a running stack: docker compose --profile cpu up -d first.
compose-demo:
	./scripts/compose_demo.sh

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt:
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .venv-lowest .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
