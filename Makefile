# fedlore: `make run` runs the main job, `make test` runs the checks. Both create .venv and
# install what they need on first use (again only when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH_PIP_ARGS ?=
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: run test lint docs install data bench clean mutation

# The Debian data packages the tests read (fortunes corpus, Fashion-MNIST). Installed when this
# runs as root with apt-get and a reachable package index; otherwise the tests that need them
# skip, each with its reason. Never fails the build.
DEB_DATA := fortunes fortunes-min dataset-fashion-mnist

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned (2.13.0, the CPU build of our machines); install it first so that no
	# later requirement pulls another build. TORCH_PIP_ARGS picks where it comes from: PyPI's
	# Linux wheel is the CUDA build (several GB more); TORCH_PIP_ARGS="--index-url
	# https://download.pytorch.org/whl/cpu" gets the CPU one. Empty: pip's own configuration.
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,flower,docs,tracking,hf,tune]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/fedlore run $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts experiments docs/conf.py docs/_ext
	$(BIN)/ruff format --check src tests benchmarks scripts experiments docs/conf.py docs/_ext
	$(BIN)/lint-imports --no-cache
	@# mypy and the docs build each keep one core busy for about a minute: side by side they
	@# take the longer one's time (about 35 s less on two cores). mypy's report is printed after.
	@$(BIN)/mypy > $(VENV)/mypy.out 2>&1 & mypy=$$!; \
	trap 'kill $$mypy 2>/dev/null; exit 130' INT TERM; \
	$(MAKE) --no-print-directory docs; docs=$$?; \
	wait $$mypy; typed=$$?; cat $(VENV)/mypy.out; \
	test $$docs = 0 && test $$typed = 0

# The documentation site (docs/, Sphinx + furo + MyST): built from scratch, offline, every
# warning an error (a broken link, an unknown configuration key, a key without a description).
# Open docs/_build/html/index.html in a browser.
docs: $(STAMP)
	$(BIN)/sphinx-build -E -W --keep-going -q -b html docs docs/_build/html

data:
	@missing=$$(for p in $(DEB_DATA); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then echo "data packages present: $(DEB_DATA)"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "not installing $$missing (needs root and apt-get); their tests will skip"; \
	else \
	  echo "installing $$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null 2>&1; } || \
	  echo "apt-get could not install $$missing (no package index?); their tests will skip"; \
	fi

# Two pytest workers (pytest-xdist): every test process keeps one torch thread
# (tests/conftest.py), so two workers fill two cores; 15.5 -> 11.6 min measured on two cores.
# The 25 slowest tests are listed at the end, to watch CI's 20-minute budget (where the time
# goes, and the rules that keep it inside: docs/development/tests.md).
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=25
test: lint data
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Mutation testing with mutmut (scripts/mutation.py, docs/development/mutation.md); not part of `make test`
# (minutes per group). MODULES picks groups of [tool.fedlore.mutation] in pyproject.toml by name
# or path, e.g. `make mutation MODULES=src/fedlore/robust.py` (default: every group); JOBS
# mutants run at once. mutmut's copies and results go to .mutation/<group>/ (kept between runs).
MODULES ?=
JOBS    ?= 1
mutation: $(STAMP)
	nice -n 10 $(BIN)/python scripts/mutation.py --jobs $(JOBS) $(MODULES)

bench: $(STAMP)
	$(BIN)/python benchmarks/round_time.py

clean:
	rm -rf $(VENV) runs docs/_build .pytest_cache .mypy_cache .ruff_cache .mutation mutants
