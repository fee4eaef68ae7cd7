# Entry points for a fresh machine with Python 3.11: `make demo`, `make test` and `make bench`.
# Each sets up its own virtualenv. torch is pinned to the CPU build on purpose: an unpinned
# torch pulls a multi-GB CUDA build. GPU machines add the [llm]/CUDA stack themselves.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PIP    := $(VENV)/bin/python -m pip
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast bench bench-quick screenshot clean

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)" -e ".[examples,test]"
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) install -q "$(TORCH)" -e ".[examples,bench]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python scripts/demo.py

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -ra

test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -ra -m "not slow"

# raw model loop vs streaming loop vs plain Ray Data vs the provider, as ratios measured in one run
# (~15 min on 2 cores); results in benchmarks/results/latest.{json,png}. BENCH_ARGS=--quick for small sizes.
bench: $(VENV)/.installed-bench
	$(VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)

bench-quick: $(VENV)/.installed-bench
	$(VENV)/bin/python -m benchmarks.run --quick $(BENCH_ARGS)

# real Airflow services + one REST-triggered run of the embeddings example, then a headless Chromium
# picture of the finished run (docs/screenshots/dag_run.png; 2-4 min). Needs Debian's chromium:
# apt-get install -y chromium
screenshot: $(VENV)/.installed
	$(VENV)/bin/python scripts/screenshot_ui.py $(SCREENSHOT_ARGS)

clean:
	rm -rf $(VENV) .airflow .batchinfer
