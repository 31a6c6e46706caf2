# Two commands for a newcomer: `make run` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build; users get the range in pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	# .[dev]: the report and demo extras (figures, rich table, digits data) plus the test tools
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m lit_mpstable.train

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) bench/bench_precision.py

clean:
	rm -rf $(VENV) outputs multirun lightning_logs .pytest_cache build dist *.egg-info
