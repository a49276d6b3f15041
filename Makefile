# hsq developer entry points. `make setup` first; everything else uses .venv/.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test lint fmt clean demo bench sglang-sources

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

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt:
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
