#!/usr/bin/env bash
# The GPU path on a real GPU: `bash scripts/gpu_check.sh` (from anywhere).
#
# On a machine with an NVIDIA GPU it
#   1. makes a virtualenv (.venv-gpu, or $GPU_VENV) with the project, its [examples,llm] extras and
#      the test group, pinned by the repo's constraints where they pin (ray, pyarrow, transformers...);
#      torch and vllm come as the [llm] extra resolves them (CUDA builds: the constraints pin the CPU
#      torch, which is why they are not applied to torch here);
#   2. runs the GPU tests: every test whose name says gpu/cuda (the vLLM end-to-end test in
#      tests/e2e/test_llm.py skips itself without CUDA or vllm: -rs shows why, if it did);
#   3. runs benchmarks/gpu_bench.py (MiniLM raw encode CPU vs CUDA, the provider's job with
#      num_gpus=0 and 1, and a vLLM text job) and prints its figures.
# Without a GPU it says so and exits 0: nothing is installed, nothing is measured.
#
# Env: GPU_VENV (default .venv-gpu), PYTHON (default python3.11 or python3), SKIP_INSTALL=1 (use the
# venv as it is), GPU_PYTHON (a Python that already has everything, e.g. a machine without network
# given benchmarks/offline_bundle.sh's packages on PYTHONPATH: no venv, no install), GPU_TESTS=0
# (skip the tests), BENCH_ROWS (default 20000), GPU_OUT (default benchmarks/results/gpu-<host>.json).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

gpu_name() {
    command -v nvidia-smi >/dev/null 2>&1 || return 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 | grep . || return 1
}

if ! GPU="$(gpu_name)"; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or lists no device):"
    echo "gpu_check: GPU tests and GPU benchmark NOT run; nothing measured."
    exit 0
fi
echo "gpu_check: GPU: $GPU"

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV="${GPU_VENV:-.venv-gpu}"
CONSTRAINTS="constraints/constraints-3.11.txt"
if [[ -n "${GPU_PYTHON:-}" ]]; then
    SKIP_INSTALL=1
fi
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade "pip>=25.1"
    # the constraints without the packages the [llm] extra must resolve itself (CUDA torch and
    # what vllm pins exactly); everything else stays at the tested versions
    grep -viE '^(torch|torchvision|torchaudio|triton|nvidia-|xformers|vllm|flashinfer)' "$CONSTRAINTS" >"$VENV/constraints-gpu.txt"
    if ! "$VENV/bin/python" -m pip install -q -c "$VENV/constraints-gpu.txt" -e ".[examples,llm]" --group test; then
        echo "gpu_check: the [llm] extra does not resolve within $CONSTRAINTS; installing it unconstrained" >&2
        "$VENV/bin/python" -m pip install -q -e ".[examples,llm]" --group test
    fi
fi
PY="${GPU_PYTHON:-$VENV/bin/python}"
"$PY" - <<'EOF'
import importlib.util, torch
print(f"gpu_check: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
      f"devices: {torch.cuda.device_count()}, vllm installed: {importlib.util.find_spec('vllm') is not None}")
EOF

TESTS_RC=0
if [[ "${GPU_TESTS:-1}" != 0 ]]; then
    echo "gpu_check: GPU tests"
    set +e
    "$PY" -m pytest -q -rs -p no:cacheprovider -k "gpu or cuda" tests/
    TESTS_RC=$?
    set -e
else
    echo "gpu_check: GPU tests skipped (GPU_TESTS=0)"
fi

echo "gpu_check: GPU benchmark"
mkdir -p benchmarks/results
OUT="${GPU_OUT:-benchmarks/results/gpu-$(hostname -s).json}"
"$PY" -m benchmarks.gpu_bench --rows "${BENCH_ROWS:-20000}" ${GPU_BENCH_ARGS:-} --out "$OUT"
echo "gpu_check: figures written to $OUT; GPU tests exit status $TESTS_RC"
exit "$TESTS_RC"
