# `make test` and `make up` set everything up on a fresh machine (Python 3.11, pip, make).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: test lint typecheck unit up demo-models clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check dynamo_prep tests scripts

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck unit

up: $(STAMP)
	$(BIN)/dynamo-prep up

demo-models: $(STAMP)
	$(BIN)/python scripts/make_demo_models.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
