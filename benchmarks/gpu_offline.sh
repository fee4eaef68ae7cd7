#!/usr/bin/env bash
# The GPU benchmark on a GPU machine WITHOUT network access whose Python already has CUDA torch and
# sentence-transformers (a CUDA image): `bash benchmarks/gpu_offline.sh`, after
# `benchmarks/offline_bundle.sh` has put the missing packages in .device/ (built where pip works,
# carried along with the checkout). It unpacks them onto PYTHONPATH, puts a `ray` command on PATH,
# and runs scripts/gpu_check.sh with that Python (no venv, no install, no tests) over MiniLM-L6's
# architecture with random weights (see benchmarks/gpu_bench.py: minilm_folder).
# Env: BUNDLE (default .device), SITE (default /tmp/batchinfer-site), GPU_PYTHON (default python3),
# BENCH_ROWS (default 100000), MLP_ROWS (default 10000000), GPU_BENCH_EXTRA (more gpu_bench.py
# arguments, e.g. --variants), GPU_OUT.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE="${BUNDLE:-$REPO/.device}"
SITE="${SITE:-/tmp/batchinfer-site}"
export GPU_PYTHON="${GPU_PYTHON:-$(command -v python3)}"
if [[ ! -f "$BUNDLE/site.tar.xz" ]]; then
    echo "gpu_offline: no $BUNDLE/site.tar.xz: run benchmarks/offline_bundle.sh where pip works first" >&2
    exit 2
fi
mkdir -p "$SITE/bin"
tar -xJf "$BUNDLE/site.tar.xz" -C "$SITE"
printf '#!/bin/sh\nexec "%s" -m ray.scripts.scripts "$@"\n' "$GPU_PYTHON" >"$SITE/bin/ray"
chmod +x "$SITE/bin/ray"
export PATH="$SITE/bin:$PATH"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$(mktemp -d)}"
export GPU_TESTS=0
export BENCH_ROWS="${BENCH_ROWS:-100000}"
export GPU_BENCH_ARGS="--mlp-rows ${MLP_ROWS:-10000000} --minilm-dir $BUNDLE/minilm --no-cpu ${GPU_BENCH_EXTRA:-}"
exec bash "$REPO/scripts/gpu_check.sh"
