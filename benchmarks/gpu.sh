#!/usr/bin/env bash
# GPU benchmark: `bash benchmarks/gpu.sh` (or `make bench-gpu`) on a machine with an
# NVIDIA GPU. Installs what it needs into .venv-gpu (CUDA torch and vLLM through the [llm] extra,
# see scripts/gpu_check.sh), runs the GPU tests, then benchmarks/gpu_bench.py:
#   - MiniLM over 100k texts: raw `encode` on the GPU vs the operator with JobSpec(num_gpus=1);
#   - the torch MLP over 10M rows: raw CUDA loop vs the operator on one GPU;
#   - a small LLM through vLLM: the operator's generated tokens/s vs vLLM's own offline LLM.chat;
# and prints the ratios. Without a GPU it says so and measures nothing (exit 0).
# Env: BENCH_ROWS (MiniLM rows, default 100000), MLP_ROWS (default 10000000), plus gpu_check.sh's.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export BENCH_ROWS="${BENCH_ROWS:-100000}"
export GPU_BENCH_ARGS="--mlp-rows ${MLP_ROWS:-10000000}"
exec bash "$REPO/scripts/gpu_check.sh"
