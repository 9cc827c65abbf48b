# Quick start: `make demo` then `make test`. Both create .venv and install the project first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch/torchvision pinned to the builds this machine's pip takes from local disk
TORCH_PIN := torch==2.14.1 torchvision==0.29.1
DEMO_DIR ?= demo_run
# pytest-xdist workers for `make test`: most tests wait on the tool in a subprocess, so two run
# well on 2 cores; more oversubscribe the 2-rank tests and gained little when measured (22m03s
# with 2 workers, 21m20s with 3, the same hour on the 2-core machine; most of the suite's CPU time
# is the tool's processes importing torch)
TEST_WORKERS ?= 2

.PHONY: venv demo test bench clean

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) tools/demo.py --folder $(DEMO_DIR)

# bytecode written once: the suite starts a few hundred processes that import ssl_engine, and
# PYTHONDONTWRITEBYTECODE (set on some CI machines) would have each compile it again
test: venv
	$(PY) -m compileall -q ssl_engine tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist load --durations=15 -m "not gpu" tests

# the peers the benchmark runs next to the engine (PyTorch Ignite, Lightning) and py-spy: setup.py's bench extra
$(VENV)/.bench-installed: $(VENV)/.installed setup.py
	$(PY) -m pip install -q -e ".[bench]"
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
