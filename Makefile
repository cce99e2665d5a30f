# The two commands of the README. Each creates or reuses .venv and installs the
# pinned requirements first: `make train` what the code imports (requirements.txt),
# `make test` the test tools too (requirements-dev.txt, which includes it, and the
# sweep tests' PostgreSQL server as a wheel). The stamp files make the reuse cheap.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp
DEV_STAMP := $(VENV)/.requirements-dev.stamp

.PHONY: train test install install-dev clean

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
test: $(DEV_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
