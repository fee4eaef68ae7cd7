"""What a mechanism saves on a real Airflow task: the scheduler, a LocalExecutor worker and the
triggerer run the example DAGs on the embedded default, and each scoring task's wall time is read
from the REST API (the task instance's start and end), with the mechanism on and off.

Mechanisms: ``spares`` (warm runtime processes, ``BATCHINFER_WARM_RUNTIME``) and ``driver`` (a
one-replica CPU job scored in the runtime's own process rather than on an actor pool of the
embedded Ray, ``BATCHINFER_IN_DRIVER_MAX_ROWS=0`` turning it off). Two typical jobs: the tabular
example at 100k rows (a TorchScript MLP) and the embeddings example at 10k texts (a
sentence-transformers MiniLM). Each mechanism, workload and mode gets its own Airflow and its own
embedded Ray state directory; one warm-up run is not counted (the first Ray start, cold page
caches); then ``--runs`` timed runs, with the machine waited idle before each, and, with spares
on, the next spare ready (a nightly job finds it ready: runs are hours apart).

    .venv/bin/python -m benchmarks.mechanisms [--mechanisms spares,driver] [--only <dag id>] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = {
    # dag id: (the scoring task, the run's conf)
    "batchinfer_tabular_scoring": ("score_customers", {"num_customers": 100_000}),
    "batchinfer_ticket_embeddings": ("embed_tickets", {"num_tickets": 10_000}),
}
# mechanism: {mode: the environment of the Airflow services in that mode}
MECHANISMS = {
    "spares": {"on": {"BATCHINFER_WARM_RUNTIME": "1"}, "off": {"BATCHINFER_WARM_RUNTIME": "0"}},
    "driver": {"on": {}, "off": {"BATCHINFER_IN_DRIVER_MAX_ROWS": "0"}},
}


def _since(ti: dict, start: str) -> float:
    return (datetime.fromisoformat(ti["end_date"]) - datetime.fromisoformat(ti[start])).total_seconds()


def _run_once(services, dag_id: str, task_id: str, conf: dict) -> dict:
    t0 = time.monotonic()
    run_id = services.trigger(dag_id, conf)
    state = services.wait_for_run(dag_id, run_id, timeout=900)
    wall = time.monotonic() - t0
    if state != "success":
        raise RuntimeError(f"{dag_id} {run_id} ended {state}: {services.task_states(dag_id, run_id)}")
    tis = services.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
    (ti,) = [t for t in tis if t["task_id"] == task_id]
    return {"task_s": round(_since(ti, "start_date"), 2), "run_s": round(wall, 2)}


def measure(dag_id: str, env_extra: dict[str, str], label: str, runs: int, root: Path) -> list[dict]:
    """``runs`` timed runs of ``dag_id`` on fresh Airflow services started with ``env_extra``."""
    from airflow_provider_batchinfer.launchers.embedded import embedded_ray, warm_runtime
    from airflow_provider_batchinfer.launchers.embedded.procs import free_ports
    from benchmarks.idle import wait_for_idle
    from tests.airflow_services import AirflowServices, services_env

    home = root / label.replace(" ", "-").replace("/", "-")
    (home / "airflow").mkdir(parents=True)
    ray_dir = Path(tempfile.mkdtemp(prefix="bim-", dir="/tmp"))  # short: Ray's socket paths live below it
    bundles = [
        {
            "name": "batchinfer_examples",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(REPO / "example_dags"), "refresh_interval": 0},
        }
    ]
    (port,) = free_ports(1)
    env = services_env(
        home / "airflow",
        port,
        bundles,
        {
            "BATCHINFER_HOME": str(home / "batchinfer"),
            "BATCHINFER_RAY_DIR": str(ray_dir),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **env_extra,
        },
    )
    env.pop("RAY_ADDRESS", None)
    services = AirflowServices(home / "airflow", port, env)
    services.start()
    task_id, conf = WORKLOADS[dag_id]
    timed = []
    try:
        services.wait_for_dag(dag_id)
        _run_once(services, dag_id, task_id, conf)  # warm-up, not counted
        for _ in range(runs):
            warm_runtime.wait_ready(ray_dir / "spares", timeout=120)
            settled = wait_for_idle()
            load = os.getloadavg()[0]
            timed.append({**_run_once(services, dag_id, task_id, conf), "settled_s": settled, "load1": load})
            print(f"  {label:50s} {timed[-1]}", flush=True)
    finally:
        services.stop()
        for spares in (ray_dir / "spares").glob("*"):
            warm_runtime.stop_spares(spares)
        embedded_ray.shutdown(ray_dir)
        shutil.rmtree(ray_dir, ignore_errors=True)
    return timed


def summarize(on: list[dict], off: list[dict]) -> dict:
    median_on = statistics.median(r["task_s"] for r in on)
    median_off = statistics.median(r["task_s"] for r in off)
    return {
        "task_s_median_on": median_on,
        "task_s_median_off": median_off,
        "saving_fraction": round((median_off - median_on) / median_off, 3),
        "run_s_median_on": statistics.median(r["run_s"] for r in on),
        "run_s_median_off": statistics.median(r["run_s"] for r in off),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS))
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated DAG ids")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mechanisms.json"))
    args = parser.parse_args()
    out = Path(args.out)
    # a run of some mechanisms or workloads keeps the latest figures of the others
    report = json.loads(out.read_text()) if out.exists() else {}
    report.update(
        what="scoring task wall time (TI start to end) on a real scheduler + LocalExecutor worker, embedded default",
        cores=os.cpu_count(),
    )
    with tempfile.TemporaryDirectory(prefix="bi-mech-") as tmp:
        for mechanism in args.mechanisms.split(","):
            for dag_id in args.only.split(","):
                runs = {
                    mode: measure(dag_id, env, f"{mechanism} {mode} {dag_id}", args.runs, Path(tmp))
                    for mode, env in MECHANISMS[mechanism].items()
                }
                key = f"{mechanism}/{dag_id}"
                report.setdefault("runs", {})[key] = runs
                report.setdefault("summary", {})[key] = summarize(runs["on"], runs["off"])
                out.write_text(json.dumps(report, indent=2) + "\n")
                print(key, json.dumps(report["summary"][key]), flush=True)


if __name__ == "__main__":
    main()
