# gpu_bench at HEAD on the device: MiniLM 100k and the MLP over 10M rows.
set -u
REPO=$(pwd); SITE=/tmp/bsite; mkdir -p $SITE/bin; tar -xJf .device/site.tar.xz -C $SITE
printf '#!/bin/sh\nexec python3 -m ray.scripts.scripts "$@"\n' >$SITE/bin/ray; chmod +x $SITE/bin/ray
export PATH=$SITE/bin:$PATH AIRFLOW_HOME=$(mktemp -d) PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$REPO
nvidia-smi -L; echo "load $(cat /proc/loadavg) $(date +%T)"
timeout 250 python3 benchmarks/gpu_bench.py --rows 100000 --mlp-rows 10000000 --minilm-dir .device/minilm --no-cpu --out $OUT/gpu-h100-full.json >$OUT/full.log 2>&1; echo "exit $?"
grep -aE "sentence_transformers on|replica ready|committed|raw |provider job|steady|/ raw|Traceback|Error" $OUT/full.log | cut -c1-300 | tail -20
echo "== done $(date +%T) load $(cat /proc/loadavg)"
