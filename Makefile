# Undertow: the two commands a user types are `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint bench clean secrets

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/undertow demo

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: install
	for b in benchmarks/*.py; do $(PY) $$b --json || exit 1; done

clean:
	rm -rf $(VENV) .undertow .pytest_cache .mypy_cache .ruff_cache

secrets: install
	$(VENV)/bin/undertow config secrets --output deploy/.env
