# `make demo` and `make test` each do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# One resolver pass: torch pinned beside the project (bench too: tests check that
	# accelerate and optimem run on the simulated CUDA device).
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1 -e '.[dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/adaptmem demo

# Two workers: the suite took 413-456 s in one process on the 2-core development VM, near
# the 10-minute bound with the install; 291-299 s on two (2026-11-28).
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/trace_cost.py
	$(PY) benchmarks/batch_search.py
	$(PY) benchmarks/paging.py
	$(PY) benchmarks/chunking.py
	$(PY) benchmarks/loading.py
	$(PY) benchmarks/spill.py

lint: $(STAMP)
	$(VENV)/bin/ruff check adaptmem tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
