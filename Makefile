# Two commands: `make demo` (the main job) and `make test` (the suite). Both create and reuse a
# local virtual environment in .venv; delete it (`make clean-venv`) to start over.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.omniloom-installed

.PHONY: demo test test-all install clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned to the builds the reference machines carry on disk; the range in
	# pyproject.toml admits them, so the editable install below adds nothing heavier.
	$(PY) -m pip install --quiet --disable-pip-version-check "torch==2.14.1" "torchvision==0.29.1"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/pytest -q

test-all: $(STAMP)
	$(VENV)/bin/pytest -q --run-slow

demo: $(STAMP)
	$(VENV)/bin/omniloom demo

clean-venv:
	rm -rf $(VENV)
