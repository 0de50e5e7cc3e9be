# Two commands: `make demo` (the main job) and `make test` (the suite). Both create and reuse a
# local virtual environment in .venv; delete it (`make clean-venv`) to start over.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.omniloom-installed

.PHONY: demo test test-all install clean-venv gpu-check bench

# torch first, pinned to the builds the reference machines carry on disk; the range in
# pyproject.toml admits them, so the editable install after it adds nothing heavier.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
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

# On a CUDA machine: kernel parity + timings, attention backends, one training step (< 8 min on an H200).
gpu-check: $(STAMP)
	$(PY) -m omniloom.pretrain.bench.gpu_check --out $${OUT:-gpu_check_out}

bench: $(STAMP)
	$(VENV)/bin/omniloom bench

clean-venv:
	rm -rf $(VENV)
