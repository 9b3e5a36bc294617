# Everything bootstraps from PyPI into .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hyparflow-installed
EXTRAS ?= cpu,mpi,test,bench

.PHONY: venv demo test test-fast test-mpi bench clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hyparflow-run -n 4 $(PY) examples/resnet_cifar.py --partitions 2 --replicas 2 --depth 20 --epochs 2 --samples 512

test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/mpi

test-mpi: $(STAMP)
	$(PY) -m pytest -q tests/mpi

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/pipeline.py

clean:
	rm -rf $(VENV) build *.egg-info
