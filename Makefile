# Entry points for a fresh machine with Python 3.11: `make demo`, `make test` and `make bench`.
# Each sets up its own virtualenv from the tested set in $(CONSTRAINTS). torch is pinned to the CPU
# build on purpose: an unpinned torch pulls a multi-GB CUDA build. GPU machines add the [llm]/CUDA
# stack themselves.
#
# `make constraints` regenerates $(CONSTRAINTS): a clean virtualenv with the project, its extras,
# every dependency group and $(TORCH), resolved by pip from pyproject.toml's ranges, then frozen.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PIP    := $(VENV)/bin/python -m pip
TORCH  ?= torch==2.13.0
CONSTRAINTS ?= constraints/constraints-3.11.txt
EXTRAS := examples,openlineage
# pip >= 25.1 installs PEP 735 dependency groups (--group); only `make constraints` resolves with pip
PIP_MIN := pip>=25.1
# pip --no-compile: byte-compiling every installed file is most of pip's CPU; imports compile and cache what
# they use, which needs bytecode writing on (an inherited PYTHONDONTWRITEBYTECODE=1 recompiles in every process)
NO_COMPILE := --no-compile
unexport PYTHONDONTWRITEBYTECODE
# The venvs get torch and uv from pip, then everything else from uv, pinned by the same constraints file.
# pip takes torch ($(TORCH), the CPU build where pip's configuration lists it) and uv looks only at the
# package index, where a torch it had to install itself is a CUDA build; with torch installed, uv keeps
# it. uv downloads and unpacks in parallel, links files from its cache (~/.cache/uv, UV_CACHE_DIR) and,
# like --no-compile, writes no bytecode; it installs dependency groups (--group) itself.
UV_REQ := uv==0.13.8
UV_INSTALL := $(VENV)/bin/uv pip install -q --python $(VENV)/bin/python -c $(CONSTRAINTS)

.PHONY: demo test test-unit test-fast lint smoke-lowest constraints bench bench-quick bench-scale bench-gpu screenshot clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(NO_COMPILE) --no-deps -c $(CONSTRAINTS) "$(UV_REQ)" "$(TORCH)"
	$(UV_INSTALL) -e ".[$(EXTRAS)]" --group test --group lint
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(UV_INSTALL) -e ".[$(EXTRAS)]" --group bench
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python scripts/demo.py

# the whole suite (every tier under tests/), with lint (format check and type check) and the
# lowest-supported-versions smoke job (its own virtualenv: mostly download and unpacking) running
# beside it; their logs are printed at the end, and any of the three failing fails the target.
# Also beside it, as root on Debian, Debian's chromium is installed if missing (for the browser test).
# Two pytest-xdist workers, each with its own Airflow home, Ray cluster and S3 server (tests/conftest.py),
# each taking whole test files: most of the suite waits on schedulers and Ray, so two overlap on 2 cores.
PYTEST_WORKERS ?= 2
test: $(VENV)/.installed
	@smoke_log=$$(mktemp /tmp/batchinfer-smoke-lowest-XXXXXX); lint_log=$$(mktemp /tmp/batchinfer-lint-XXXXXX); \
	browser_log=$$(mktemp /tmp/batchinfer-chromium-XXXXXX); scripts/install_chromium.sh > $$browser_log 2>&1 & browser=$$!; \
	PYTHON=$(PYTHON) UV_REQ="$(UV_REQ)" scripts/lowest_versions_smoke.sh > $$smoke_log 2>&1 & smoke=$$!; \
	$(MAKE) --no-print-directory lint > $$lint_log 2>&1 & lint=$$!; \
	trap 'kill $$smoke $$lint $$browser 2>/dev/null' INT TERM; \
	$(VENV)/bin/python -m pytest -q -ra --durations=25 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder; \
	suite=$$?; wait $$lint; linted=$$?; wait $$smoke; lowest=$$?; wait $$browser; \
	echo "== lint (ran beside the suite), exit $$linted:"; cat $$lint_log; rm -f $$lint_log; \
	echo "== browser for the UI test:"; cat $$browser_log; rm -f $$browser_log; \
	echo "== lowest-versions smoke (ran beside the suite), exit $$lowest:"; cat $$smoke_log; rm -f $$smoke_log; \
	test $$suite -eq 0 && test $$linted -eq 0 && test $$lowest -eq 0

# the fast loop: tests/unit alone (no Ray, no subprocess, no Airflow DB; under 3 minutes)
test-unit: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q tests/unit

# tests/unit and tests/component: everything but the jobs on Ray and the real services
test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -ra -m "not slow"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# the floors (constraints/lowest-3.11.txt) in .venv-lowest: provider import, `airflow providers list`,
# one example DAG through dag.test() (~5 min the first time, ~1 min after)
smoke-lowest:
	PYTHON=$(PYTHON) UV_REQ="$(UV_REQ)" scripts/lowest_versions_smoke.sh

constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install -q --upgrade "$(PIP_MIN)"
	.venv-constraints/bin/python -m pip install -q "$(TORCH)" -e ".[$(EXTRAS)]" --group test --group lint --group bench
	.venv-constraints/bin/python -m pip check
	{ echo "# The tested set for Python 3.11: \`make constraints\` (a clean venv with the project's extras"; \
	  echo "# [$(EXTRAS)], every dependency group and $(TORCH), then pip freeze). Used by make demo/test/bench"; \
	  echo "# and docker/*.Dockerfile: pip install -c $(CONSTRAINTS) ..."; \
	  .venv-constraints/bin/python -m pip freeze --exclude-editable | sed -E 's/^(torch==[^+]*)\+cpu$$/\1/'; \
	} > $(CONSTRAINTS).tmp
	mv $(CONSTRAINTS).tmp $(CONSTRAINTS)
	rm -rf .venv-constraints

# raw model loop vs streaming loop vs plain Ray Data vs the provider, as ratios measured in one run
# (~22 min on 2 cores), then XGBoost and LightGBM 1M rows against their own predict, 3 runs each (~5 min); results in
# benchmarks/results/latest.{json,png} and trees.{json,log}. BENCH_ARGS=--quick for small sizes.
bench: $(VENV)/.installed-bench
	$(VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)
	$(VENV)/bin/python -m benchmarks.trees --only xgboost,lightgbm

bench-quick: $(VENV)/.installed-bench
	$(VENV)/bin/python -m benchmarks.run --quick $(BENCH_ARGS)

# 200M rows in 20 Parquet files (about 5 GB under $$BATCHINFER_SCALE_DATA, default /tmp/batchinfer-scale, reused),
# scored with no id column, with id_column and SaveMode.RESUME, and as a RESUME with half the rows kept, on the
# driver and on the actor pool (replicas=2): peak RSS against a 2M-row run and rows/s against the no-id job, in
# benchmarks/results/scale-200000000.json. SCALE_ARGS="--rows 20000000" for a smaller check.
bench-scale: $(VENV)/.installed-bench
	$(VENV)/bin/python -m benchmarks.scale $(SCALE_ARGS)

# real Airflow services + one REST-triggered run of the embeddings example, then a headless Chromium
# picture of the finished run (docs/screenshots/dag_run.png; 2-4 min). Needs Debian's chromium:
# apt-get install -y chromium
screenshot: $(VENV)/.installed
	$(VENV)/bin/python scripts/screenshot_ui.py $(SCREENSHOT_ARGS)

clean:
	rm -rf $(VENV) .venv-lowest .venv-constraints .airflow .batchinfer

# on a machine with an NVIDIA GPU: installs the CUDA stack and runs the GPU benchmark (benchmarks/gpu.sh)
bench-gpu:
	bash benchmarks/gpu.sh
