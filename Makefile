# Everything a fresh machine needs: Python 3.11, pip and git.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast demo demo-lm demo-multihost bench bench-cluster clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: $(STAMP)
	$(PY) examples/train_digits.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
