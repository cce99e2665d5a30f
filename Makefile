# The two commands of the README. Each creates or reuses .venv and installs the
# pinned requirements first: `make train` what the code imports (requirements.txt),
# `make test` the test tools too (requirements-dev.txt, which includes it, and the
# sweep tests' PostgreSQL server as a wheel), the catalog's preparation environment
# and Debian's Chromium for the report's browser tests. The stamp files make the reuse cheap.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp
DEV_STAMP := $(VENV)/.requirements-dev.stamp
# The catalog's preparation environment (see `prepare` below).
PREPARE_VENV := .venv-prepare
PREPARE_STAMP := $(PREPARE_VENV)/.requirements.stamp

.PHONY: train test lint install install-dev chromium clean prepare prepare-env

install: $(STAMP)
install-dev: $(DEV_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): requirements.txt | $(PY)
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

$(DEV_STAMP): requirements.txt requirements-dev.txt requirements-tensorboard.txt | $(PY)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP) $(DEV_STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# Two pytest-xdist workers (one per core of the 2-core CI machine; TEST_WORKERS=0 runs in one
# process); a test's own subprocesses share the session's compilation cache with both.
TEST_WORKERS ?= 2
test: $(DEV_STAMP) $(PREPARE_STAMP) chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests $(ARGS)

# One formatter and linter for the whole tree (pyproject.toml configures ruff; .ci/run runs this first).
lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Preparing a TFDS catalog dataset (docs/usage.md, "Preparing a catalog dataset") runs in its own
# environment: TFDS needs TensorFlow to download and extract, training does not. The tests of
# tests/test_prepare_catalog.py use it too.
prepare-env: $(PREPARE_STAMP)

$(PREPARE_STAMP): requirements-prepare.txt
	test -x $(PREPARE_VENV)/bin/python || $(PYTHON) -m venv $(PREPARE_VENV)
	$(PREPARE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PREPARE_VENV)/bin/python -m pip install --quiet -r requirements-prepare.txt
	touch $(PREPARE_STAMP)

# make prepare DATASET=wmt14_translate/de-en [DATA_DIR=dir (default $$TFDS_DATA_DIR, else data/tfds)] [MANUAL_DIR=dir]
prepare: $(PREPARE_STAMP)
	@test -n "$(DATASET)" || { echo "make prepare: give DATASET=name, e.g. DATASET=wmt14_translate/de-en"; exit 2; }
	$(PREPARE_VENV)/bin/python tools/prepare_catalog.py $(DATASET) $(if $(DATA_DIR),--data_dir=$(DATA_DIR)) $(if $(MANUAL_DIR),--manual_dir=$(MANUAL_DIR))

# The report's browser tests open the pages in headless Chromium (driven by Playwright, whose own
# browser download is not used): install Debian's package if absent. Where it cannot be installed
# (no root and no sudo, no apt) `make test` goes on, and those tests skip, naming it.
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)
CHROMIUM := /usr/bin/chromium
chromium:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; } \
		|| echo "make chromium: Debian's chromium could not be installed (it needs root or sudo): the report's browser tests will skip"

clean:
	rm -rf $(VENV) $(PREPARE_VENV) .pytest_cache
