# Tandem: `make run` starts the platform, `make test` runs the whole suite. Both install first.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

# TANDEM_DATA_DIR, BENTOML_HOME and DAGSTER_HOME default to folders of ./data in inference/homes.py,
# not here: a command run outside make must find the same folders.

.PHONY: install run demo test lint format clean bench bench-quick

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# Materializes the demo days through Dagster, then keeps the Dagster UI (:3000), the daemon and the
# scoring service (:3001) up until Ctrl-C.
run: install
	$(BIN)/python -m orchestration.platform

# The core alone, no Dagster: generate, train, score one day, print a summary.
demo: install
	$(BIN)/tandem demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest

# Benchmarks print their numbers; `bench` writes bench/results/*.json and bench/report.md (+ PNG plots),
# `bench-quick` the same into a temporary directory (it prints where).
bench: install
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m bench.run

bench-quick: install
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m bench.run --quick

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# .env too when Tandem wrote it (orchestration/instance.py): it names the data/dagster removed here.
clean:
	rm -rf $(VENV) data .pytest_cache .mypy_cache .ruff_cache
	@if head -n 1 .env 2>/dev/null | grep -q '^# Written by Tandem'; then rm .env; fi
