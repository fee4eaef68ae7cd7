#!/usr/bin/env bash
# Lowest supported versions smoke job: install the floors (constraints/lowest-3.11.txt) into their own
# virtualenv and check that the provider imports, that the embedded Ray runs with token auth at the
# Ray floor (scripts/embedded_ray_auth_check.py), that `airflow providers list` shows it, and that one
# example DAG (batchinfer_tabular_scoring: train, score on a local Ray, sensor, publish) succeeds
# through dag.test() on a SQLite metadata DB in a throw-away AIRFLOW_HOME.
# Usage: scripts/lowest_versions_smoke.sh   (make smoke-lowest; part of make test). ~5 min cold, ~1 min warm.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${LOWEST_VENV:-.venv-lowest}
[[ $VENV = /* ]] || VENV=$REPO/$VENV
FLOORS=constraints/lowest-3.11.txt
start=$(date +%s)
# installed without .pyc (--no-compile: most of pip's CPU; uv writes none); imports compile what they use
# and cache it
unset PYTHONDONTWRITEBYTECODE
# torch from pip (the floor's build where pip's configuration lists it; from the index uv would take the
# CUDA build), everything else from uv (see the Makefile), which keeps the torch pip installed
UV_REQ=${UV_REQ:-uv==0.13.8}

# (re)install only when the floors or the package's dependencies changed
deps=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"])')
stamp="$VENV/.installed-$( (cat "$FLOORS"; echo "$deps") | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --no-compile --no-deps -c "$FLOORS" "$UV_REQ" torch
    # every floor pinned; everything else resolves as a user's fresh install would
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c "$FLOORS" -e . torch
    touch "$stamp"
fi
[ "${SMOKE_INSTALL_ONLY:-0}" = 1 ] && { echo "installed $VENV in $(( $(date +%s) - start )) s"; exit 0; }
PY="$VENV/bin/python"

echo "== versions"
"$PY" - <<'PYEOF'
from importlib.metadata import version
for name in ("apache-airflow", "apache-airflow-core", "apache-airflow-task-sdk", "ray", "pyarrow", "pandas",
             "numpy", "torch", "airflow-provider-batchinfer"):
    print(f"  {name}=={version(name)}")
PYEOF

home=$(mktemp -d /tmp/batchinfer-lowest-XXXXXX)
# the job's embedded Ray (if a job started one: a one-replica job starts none) gets its own state dir
# and is stopped on the way out; `stop` exits 1 when no Ray runs, which is no failure of the smoke
export BATCHINFER_RAY_DIR=$(mktemp -d /tmp/bir-lo-XXXXXX)
trap '"$PY" -m airflow_provider_batchinfer.launchers.embedded.embedded_ray stop "$BATCHINFER_RAY_DIR" >/dev/null 2>&1 || true; rm -rf "$home" "$BATCHINFER_RAY_DIR"' EXIT
export AIRFLOW_HOME="$home/airflow" BATCHINFER_HOME="$home/batchinfer"
export AIRFLOW__CORE__LOAD_EXAMPLES=False AIRFLOW__CORE__DAGS_FOLDER="$REPO/example_dags"
export AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT=120 AIRFLOW__OPENLINEAGE__DISABLED=True
# dag.test()'s in-process execution API signs task tokens; Airflow 3.2 does not generate this key itself
export AIRFLOW__API_AUTH__JWT_SECRET="batchinfer-smoke-$RANDOM$RANDOM"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset RAY_ADDRESS  # the embedded default: the provider's warm local Ray, started on first use
export PYTHONPATH="$REPO"

echo "== provider import (no Ray, no torch loaded by the import)"
"$PY" -c '
import sys
import airflow_provider_batchinfer as p
from airflow_provider_batchinfer import BatchInferenceOperator, SuccessMarkerSensor, ModelServiceHook
heavy = sorted(m for m in ("ray", "torch") if m in sys.modules)
assert not heavy, f"importing the provider loaded {heavy}"
print("  ok:", p.__name__)
'

echo "== the Ray Data APIs the runtime uses"
"$PY" -c '
import inspect
import ray.data
from ray.data.datasource.datasink import WriteResult
assert "target_num_rows_per_block" in inspect.signature(ray.data.Dataset.repartition).parameters
assert "size" in inspect.signature(ray.data.ActorPoolStrategy).parameters
assert "write_returns" in WriteResult.__dataclass_fields__
print("  ok: repartition(target_num_rows_per_block), ActorPoolStrategy(size), WriteResult.write_returns")
'

echo "== the embedded Ray refuses calls without its token (GCS, Ray Client server)"
"$PY" scripts/embedded_ray_auth_check.py --start "$BATCHINFER_RAY_DIR"

echo "== airflow providers list"
"$VENV/bin/airflow" db migrate > "$home/migrate.log" 2>&1 || { tail -50 "$home/migrate.log"; exit 1; }
"$VENV/bin/airflow" providers list -o plain > "$home/providers.txt"
grep -E "^airflow-provider-batchinfer\b" "$home/providers.txt" || { cat "$home/providers.txt"; exit 1; }

echo "== example DAG batchinfer_tabular_scoring through dag.test()"
"$PY" - <<'PYEOF'
import json
import os
import sys

from airflow.dag_processing.dagbag import DagBag

bag = DagBag(dag_folder=os.path.join(os.environ["AIRFLOW__CORE__DAGS_FOLDER"], "batchinfer_tabular_scoring.py"),
             include_examples=False)
assert not bag.import_errors, bag.import_errors
dag = bag.get_dag("batchinfer_tabular_scoring")
dr = dag.test(run_conf={"num_customers": 2000})
from airflow.models import DagRun
from airflow.utils.session import create_session

with create_session() as session:
    states = {ti.task_id: ti.state for ti in session.query(DagRun).filter_by(run_id=dr.run_id).one().get_task_instances()}
print("  tasks:", json.dumps({k: str(v) for k, v in states.items()}))
if dr.state != "success":
    sys.exit(f"batchinfer_tabular_scoring ended {dr.state}")
print("  ok: run", dr.run_id, "succeeded")
PYEOF

echo "== lowest-versions smoke passed in $(( $(date +%s) - start )) s"
