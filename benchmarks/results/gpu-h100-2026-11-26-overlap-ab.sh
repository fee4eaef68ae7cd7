# A/B on the GPU: the overlapped sentence-transformers path (this tree) vs HEAD (.device/head), MiniLM 100k.
set -u
REPO=$(pwd); SITE=/tmp/bsite; mkdir -p $SITE/bin; tar -xJf .device/site.tar.xz -C $SITE
printf '#!/bin/sh\nexec python3 -m ray.scripts.scripts "$@"\n' >$SITE/bin/ray; chmod +x $SITE/bin/ray
export PATH=$SITE/bin:$PATH AIRFLOW_HOME=$(mktemp -d) PYTHONUNBUFFERED=1
nvidia-smi -L; nproc
n=0
for tree in new head new; do
  n=$((n+1))
  dir=$REPO; [ $tree = head ] && dir=$REPO/.device/head
  echo "== run $n $tree load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
  (cd $dir && BATCHINFER_RAY_DIR=/tmp/bray-$n PYTHONPATH=$SITE:$dir timeout 170 python3 benchmarks/gpu_bench.py --rows 100000 --mlp-rows 0 --minilm-dir $REPO/.device/minilm --no-cpu --out $OUT/ab-$n-$tree.json >$OUT/ab-$n-$tree.log 2>&1; echo "exit $?")
  grep -aE "sentence_transformers on|replica ready|committed|raw encode|provider job|steady|Traceback|Error" $OUT/ab-$n-$tree.log | cut -c1-300 | tail -12
  ray stop --force >/dev/null 2>&1; sleep 1
done
echo "== done $(date +%T) load $(cat /proc/loadavg)"
