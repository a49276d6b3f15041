# hsq developer entry points. `make setup` first; everything else uses .venv/.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test lint fmt clean demo bench sglang-sources
.PHONY: dist constraints lower-bounds
.PHONY: setup-deploy compose-test slurm-test compose-demo

setup:
	./scripts/setup.sh

test:
	$(PY) -m pytest $(PYTEST_ARGS)

demo:
	$(VENV)/bin/hsq --log-format console demo

bench:
	$(PY) bench/pipeline.py

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
