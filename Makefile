# The two commands of the README. Each creates or reuses .venv and installs the
# pinned requirements first; the stamp file makes the reuse cheap.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp

.PHONY: train test install postgresql chromium clean

install: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# Two pytest-xdist workers (one per core of the 2-core CI machine; TEST_WORKERS=0 runs in one
# process); a test's own subprocesses share the session's compilation cache with both.
TEST_WORKERS ?= 2
test: $(STAMP) postgresql chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests $(ARGS)

# The sweep tests start a PostgreSQL server on loopback: install Debian's package if absent.
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq postgresql; }

# The report's browser tests open the pages in headless Chromium (driven by Playwright, whose own
# browser download is not used): install Debian's package if absent.
chromium:
	@test -x /usr/bin/chromium || { \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }

clean:
	rm -rf $(VENV) .pytest_cache
