# Both targets create their own virtual environment (.venv) and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test test-fast bench clean

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) torch==2.13.0 -e '.[test]'
	touch $@

## demo: plan the built-in example (the seed's 64-GPU mesh)
demo: $(VENV)/.base
	$(VENV)/bin/meshplan plan examples/seed-64gpu.toml --rank 29

## test: the whole test suite (CPU only; torch 2.13.0 CPU wheel); the 25 slowest tests listed at the end
test: $(VENV)/.test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=25

## test-fast: the edit loop: no multi-process runs, no exhaustive or fake-process-group checks
test-fast: $(VENV)/.test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow and not heavy"

## bench: speed goals, printed as throughputs; the step-time model against published runs
bench: $(VENV)/.base
	$(PY) benchmarks/bench_plan.py
	$(PY) benchmarks/bench_search.py
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/fidelity.py
	$(PY) benchmarks/fidelity_components.py
	$(PY) benchmarks/zero3_sc21.py

clean:
	rm -rf $(VENV)
