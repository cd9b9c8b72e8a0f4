# Everything a fresh machine needs: Python 3.11, pip and git.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install lint test test-slow test-next-jax test-all demo demo-lm demo-nnx demo-linen demo-pjit demo-sharded \
        demo-multihost demo-lm1b bench bench-cluster bench-tta bench-tta-lm bench-sharded bench-fsdp check-pods \
        docs figures wheel wheel-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Ruff's checks (pyproject.toml: [tool.ruff]); CI runs this first.
lint: $(STAMP)
	$(PY) -m ruff check .

# The suite and every docstring example, without the tests marked slow, in
# one worker process per core (at most TEST_WORKERS; each simulates 8 devices).
TEST_WORKERS ?= 4
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n auto --maxprocesses $(TEST_WORKERS)

# The slow ones: multi-process jobs and short training runs (CI runs both).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# value_and_grad's partitioning with JAX's coming primitives on (the new scan,
# remat and custom_vjp behind these flags, the defaults to be).
NEXT_JAX := JAX_SCAN3=1 JAX_REMAT3=1 JAX_CUSTOM_VJP3=1
test-next-jax: $(STAMP)
	$(NEXT_JAX) $(PY) -m pytest -q -m "not slow" -n auto --maxprocesses $(TEST_WORKERS)

test-all: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/train_digits.py

demo-lm: $(STAMP)
	$(PY) examples/train_lm.py

# The adoption examples: a flax step as written today and with SkipReduce.
demo-nnx: $(STAMP)
	$(PY) examples/nnx_cnn_digits.py

demo-linen: $(STAMP)
	$(PY) examples/linen_lm.py

# A production-style pjit loop (partitioned linen LM, TrainState, MultiSteps)
# on a (replica=4, fsdp=2) mesh, then on one replica axis.
demo-pjit: $(STAMP)
	$(PY) examples/pjit_lm.py --mesh hsdp
	$(PY) examples/pjit_lm.py --mesh dp

# A step shaped like flax's lm1b example, on 8 data ranks, then on lm1b's
# default data=1, fsdp=8.
demo-lm1b: $(STAMP)
	$(PY) examples/lm1b_lm.py --mesh data
	$(PY) examples/lm1b_lm.py --mesh fsdp --steps 20

# NNX model sharded over (fsdp, tensor), SkipReduce over replica (about 2 minutes).
demo-sharded: $(STAMP)
	$(PY) examples/train_sharded.py

demo-multihost: $(STAMP)
	$(PY) -m skipreduce_jax.launch -n 2 -d 2 examples/multihost_train.py

# The documentation site in docs/_build/html, with every warning an error.
# Its own small virtualenv: the package and the docs extra only (Sphinx,
# MyST, furo; flax for the API pages, matplotlib for the figures).
DOCS_VENV  := .venv-docs
DOCS_PY    := $(DOCS_VENV)/bin/python
DOCS_STAMP := $(DOCS_VENV)/.installed

$(DOCS_STAMP): pyproject.toml
	test -x $(DOCS_PY) || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_PY) -m pip install --quiet --upgrade pip
	$(DOCS_PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

# The site's figures (docs/_static/figures/*.png), drawn from the recorded
# results in docs/_data/ and from the library's own schedule code.
figures: $(DOCS_STAMP)
	$(DOCS_PY) docs/figures.py
	$(DOCS_PY) docs/gallery/run.py

docs: figures
	$(DOCS_VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

# The wheel and sdist in dist/ (python -m build).
wheel: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

# The wheel as a user installs it: a clean virtualenv, the wheel with its
# examples extra from the package index, then examples/pjit_lm.py (small
# settings, both variants) run from a directory outside the repository, so
# that only the installed package can be imported.
WHEEL_VENV := .venv-wheel
WHEEL_RUN  := $(or $(TMPDIR),/tmp)/skipreduce_jax-wheel-check
PJIT_SMALL := --mesh hsdp --steps 4 --accum 2 --batch-per-device 1 --seq-len 16 --d-model 16 \
              --layers 1 --heads 2 --min-size 0 --eval-every 2 --val-windows 8 \
              --train-mb 0.0625 --val-mb 0.015625

wheel-check: wheel
	rm -rf $(WHEEL_VENV) $(WHEEL_RUN)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip install --quiet "$$(ls dist/skipreduce_jax-*.whl)[examples]"
	mkdir -p $(WHEEL_RUN) && cp -r examples $(WHEEL_RUN)/
	cd $(WHEEL_RUN) && $(abspath $(WHEEL_VENV))/bin/python -E -s -c \
	    "import skipreduce_jax as sr; assert '/site-packages/' in sr.__file__, sr.__file__; \
	     print('installed', sr.__version__, 'at', sr.__file__)"
	cd $(WHEEL_RUN) && $(abspath $(WHEEL_VENV))/bin/python -E -s examples/pjit_lm.py $(PJIT_SMALL)
	rm -rf $(WHEEL_RUN)

# In-process collective timings (8 simulated CPU devices).
bench: $(STAMP)
	$(PY) benchmarks/collectives.py

# The emulated 4-host, 1 Gbit/s cluster (needs root and iproute2).
bench-cluster: $(STAMP)
	$(PY) benchmarks/cluster.py

# Time to accuracy on the emulated cluster (4 hosts at 500 Mbit/s), six
# reductions of 60 s each (about 10 minutes; needs root and iproute2).
bench-tta: $(STAMP)
	$(PY) benchmarks/cluster.py --rate 500mbit --timeout 1400 \
	    --script benchmarks/time_to_accuracy.py -- --time-budget 60 \
	    --optimizer sgd --shift 1 --name tta_cluster_h4_500mbit_sgd_shift1

# Time to accuracy of examples/train_lm.py's byte transformer on the emulated
# cluster (4 hosts at 500 Mbit/s), AdamW: all-reduce, skip_adamw, Random,
# top-k, PowerSGD, 60 s each (about 9 minutes; needs root and iproute2).
bench-tta-lm: $(STAMP)
	$(PY) benchmarks/cluster.py --rate 500mbit --timeout 1400 \
	    --script benchmarks/time_to_accuracy.py -- --workload lm --time-budget 60 \
	    --name tta_cluster_h4_500mbit_lm_adamw

# One sharded training step on the emulated cluster (4 hosts at 500 Mbit/s;
# about 1.5 minutes each; needs root and iproute2): XLA's own step against
# SkipReduce k=0 and Random. HSDP: 2 devices per host, params over "fsdp".
bench-sharded: $(STAMP)
	$(PY) benchmarks/cluster.py --rate 500mbit --hosts 4 --local-devices 2 --timeout 900 \
	    --script benchmarks/sharded_step.py -- --layout hsdp --rounds 11 \
	    --label "500 Mbit/s" --tag cluster_hsdp_h4x2_500mbit

# FSDP: 1 device per host, params P("data").
bench-fsdp: $(STAMP)
	$(PY) benchmarks/cluster.py --rate 500mbit --hosts 4 --timeout 900 \
	    --script benchmarks/sharded_step.py -- --layout fsdp --rounds 11 \
	    --label "500 Mbit/s" --tag cluster_fsdp_h4x1_500mbit

# Compile (not run) SkipReduce for a 4-slice TPU v5e pod and 2 nodes of 8
# H100s on a CPU machine: its own virtualenv with libtpu and the CUDA plugin
# (6.2 GB, about 4 minutes to install), then the tests under tests/pods/.
# libtpu is told there is no metadata server and no other TPU host to ask.
PODS_VENV  := .venv-pods
PODS_PY    := $(PODS_VENV)/bin/python
PODS_STAMP := $(PODS_VENV)/.installed

$(PODS_STAMP): pyproject.toml
	test -x $(PODS_PY) || $(PYTHON) -m venv $(PODS_VENV)
	$(PODS_PY) -m pip install --quiet --upgrade pip
	$(PODS_PY) -m pip install --quiet -e '.[pods]'
	touch $(PODS_STAMP)

check-pods: $(PODS_STAMP)
	SKIPREDUCE_PODS=1 JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 \
	    TPU_ACCELERATOR_TYPE=v5litepod-16 TPU_WORKER_HOSTNAMES=localhost \
	    $(PODS_PY) -m pytest -q tests/pods

clean:
	rm -rf $(VENV) $(PODS_VENV) $(DOCS_VENV) $(WHEEL_VENV) build dist *.egg-info \
	    .pytest_cache docs/_build docs/_static/figures
