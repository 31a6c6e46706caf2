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

# Two pytest workers, a test file each at a time (--dist loadfile: a file's module fixtures, such as the local Ray
# cluster, start once). Every test pins one thread, so two workers fill a 2-core machine: 8.5 min instead of 14.5.
WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m "not slow"

bench: $(STAMP)
	$(PY) bench/bench_precision.py

clean:
	rm -rf $(VENV) outputs multirun lightning_logs .pytest_cache build dist *.egg-info
