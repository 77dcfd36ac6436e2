# fedlore: `make run` runs the main job, `make test` runs the checks. Both create .venv and
# install what they need on first use (again only when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: run test lint install bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned (2.13.0, the CPU build of our machines); install it first so that no
	# later requirement pulls another (multi-GB CUDA) build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,flower]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/fedlore run $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/round_time.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
