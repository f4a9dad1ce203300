# The two commands: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# pytest-xdist workers for `make test`; a test mostly keeps one core busy (XLA compiles).
TEST_WORKERS ?= 2
# 8 simulated CPU devices, and LLVM's fast instruction scheduler (jaxrl/infra/xla_cpu.py).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8 --xla_backend_extra_options=-pre-RA-sched=fast
export JAX_PLATFORMS ?= cpu

.PHONY: demo test lint install install-test clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/activate
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/activate
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(PY) -m launch.demo

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
