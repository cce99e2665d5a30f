# The two commands of the README. Each creates or reuses .venv and installs the
# pinned requirements first; the stamp file makes the reuse cheap.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp

.PHONY: train test install clean

install: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

train: $(STAMP)
	@test -f train.py || { echo "make train: train.py is not written yet (issue 4, the trainer)"; exit 2; }
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
