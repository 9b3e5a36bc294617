# Everything bootstraps from PyPI into .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hyparflow-installed
EXTRAS ?= cpu,mpi,test,bench

.PHONY: venv demo test test-fast test-mpi test-cluster bench bench-quick bench-readme bench-memory bench-cluster peers clean

venv: $(STAMP)

# keras-hub's task models, for the tests (built from config: no weights, no tokenizer). Its
# tensorflow-text would install a second, full TensorFlow beside tensorflow-cpu, so it comes
# without its dependencies, and with those of them its models import.
KERAS_HUB ?= keras-hub==0.32.0 regex tokenizers

$(STAMP): setup.cfg pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip install --quiet --no-deps $(KERAS_HUB)
	touch $(STAMP)

# Plain Keras, then hyparflow on 4 ranks (the script starts hyparflow-run -n 4 itself): the same
# ResNet on the digits, accuracies side by side, and a timeline PNG in build/demo/.
demo: $(STAMP)
	$(PY) examples/demo.py

# The single-process tests on a pytest worker per core (pytest-xdist; each its own TensorFlow
# process), then the multi-rank tier on its own: its jobs oversubscribe the cores already,
# and its time-bound tests (the watchdog's "within seconds") must not share them.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n auto tests --ignore=tests/mpi
	$(PY) -m pytest -q --durations=12 tests/mpi

test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n auto tests --ignore=tests/mpi

test-mpi: $(STAMP)
	$(PY) -m pytest -q tests/mpi

# Multi-node jobs on a cluster built on this machine (network namespaces: root only; skipped
# with the reason elsewhere). Whatever happens, nothing of the box is left afterwards.
test-cluster: $(STAMP)
	HYPARFLOW_CLUSTER=1 $(PY) -m pytest -q -rs tests/cluster; \
	status=$$?; $(PY) tests/cluster/box.py cleanup; exit $$status

# The whole benchmark (about an hour here) → benchmarks/results/<machine>.md, .json, PNGs.
# The peers (Horovod, PyTorch) are installed first where they can be; one that fails to
# install is reported by the suite and left out.
bench: $(STAMP)
	-bash benchmarks/peers/setup_torch.sh
	-bash benchmarks/peers/setup_horovod.sh
	$(PY) benchmarks/suite.py

# The same configurations at ResNet-20, fewer of them, peers used if already installed.
bench-quick: $(STAMP)
	$(PY) benchmarks/suite.py --quick

# Every row of README.md's Speed table, rerun on this commit in one run (3 rounds, about 40
# minutes here), and the table rewritten from it (from a clean checkout; the record, every
# round, in benchmarks/results/readme.md and .json). Peers as for `make bench`.
bench-readme: $(STAMP)
	-bash benchmarks/peers/setup_torch.sh
	-bash benchmarks/peers/setup_horovod.sh
	$(PY) benchmarks/readme.py $(ARGS)

# The planner's memory per rank against measured peaks (about 30 minutes here): ResNet-110 v1
# and ResNet-1001 v2 at 1, 2 and 4 stages (the step graph, interleaved and ZB-H1 included), and
# ResNet-164 v2, a depth none of the planner's constants were fitted to; GPT-2, whose
# transformer blocks they do not describe; and hf.fit(partitions="auto") under a 1.2 GiB limit
# (its planning included) beside what it chose → benchmarks/results/memory_plan-*.md, .json
bench-memory: $(STAMP)
	$(PY) benchmarks/memory_plan.py --model v2 --depth 164 --configs 1x1:1f1b:1 1x2:1f1b:1 \
	  2x1:1f1b:4 2x1:interleaved:8 2x1:zb-h1:4 4x1:1f1b:4 2x2:1f1b:4 \
	  --output benchmarks/results/memory_plan-resnet164.json
	$(PY) benchmarks/memory_plan.py --configs 1x1:1f1b:1 1x2:1f1b:1 2x1:1f1b:4 2x1:gpipe:4 \
	  2x1:interleaved:8 2x1:1f1b+graph:4 2x1:interleaved+graph:8 2x1:zb-h1:4 4x1:1f1b:4 \
	  4x1:1f1b:8 4x1:interleaved:8 4x1:1f1b+graph:8 4x1:zb-h1:8 \
	  --output benchmarks/results/memory_plan-resnet110.json
	$(PY) benchmarks/memory_plan.py --model v2 --depth 1001 --batch-size 8 --timeout 2400 \
	  --configs 1x1:1f1b:1 2x1:1f1b:4 4x1:1f1b:4 4x1:interleaved:4 4x1:1f1b+graph:4 \
	  --output benchmarks/results/memory_plan-resnet1001.json
	$(PY) benchmarks/memory_plan.py --model gpt2 --depth 12 --batch-size 16 \
	  --configs 1x1:1f1b:1 1x2:1f1b:1 2x1:1f1b:4 2x1:zb-h1:4 \
	  --output benchmarks/results/memory_plan-gpt2.json
	$(PY) benchmarks/memory_plan.py --configs 2xauto:1.2 1x2:1f1b:2 \
	  --output benchmarks/results/memory_plan-auto.json

# The cluster in a box as a benchmark (root, Linux; skipped with the reason elsewhere): 1 and 2
# nodes, data parallel, pipeline and hybrid, unshaped and slow links, beside hf.plan's
# prediction → benchmarks/results/<machine>-cluster.md, .json (ResNet-56; ARGS=--quick: a
# smoke run at ResNet-20). Whatever happens, nothing of its box (hfbench) is left afterwards.
bench-cluster: $(STAMP)
	$(PY) benchmarks/cluster.py $(ARGS); \
	status=$$?; $(PY) tests/cluster/box.py cleanup hfbench; exit $$status

peers:
	bash benchmarks/peers/setup_torch.sh
	bash benchmarks/peers/setup_horovod.sh

clean:
	rm -rf $(VENV) .venv-torch .venv-horovod build *.egg-info
