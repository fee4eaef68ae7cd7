"""What a mechanism saves on a real Airflow task: the scheduler, a LocalExecutor worker and the
triggerer run the example DAGs on the embedded default, and each scoring task's wall time is read
from the REST API (the task instance's start and end), with the mechanism on and off.

Two typical jobs: the tabular example at 100k rows (a TorchScript MLP) and the embeddings example
at 10k texts (a sentence-transformers MiniLM). Each workload and mode gets its own Airflow and its
own embedded Ray state directory; one warm-up run per DAG is not counted (the first Ray start, cold page
caches); then ``--runs`` timed runs each, with the machine waited idle before each run, and, with
spares on, the next spare ready (a nightly job finds it ready: runs are hours apart).

    .venv/bin/python -m benchmarks.mechanisms [--runs 5] [--out benchmarks/results/mechanisms.json]
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
MODES = {"spares on": "1", "spares off": "0"}


def _seconds(ti: dict) -> float:
    return (datetime.fromisoformat(ti["end_date"]) - datetime.fromisoformat(ti["start_date"])).total_seconds()


def _run_once(services, dag_id: str, task_id: str, conf: dict) -> dict:
    t0 = time.monotonic()
    run_id = services.trigger(dag_id, conf)
    state = services.wait_for_run(dag_id, run_id, timeout=900)
    wall = time.monotonic() - t0
    if state != "success":
        raise RuntimeError(f"{dag_id} {run_id} ended {state}: {services.task_states(dag_id, run_id)}")
    tis = services.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
    (ti,) = [t for t in tis if t["task_id"] == task_id]
    queued = datetime.fromisoformat(ti["end_date"]) - datetime.fromisoformat(ti["queued_when"])
    return {
        "task_s": round(_seconds(ti), 2),
        "queued_to_end_s": round(queued.total_seconds(), 2),
        "run_s": round(wall, 2),
    }


def measure(dag_id: str, mode: str, flag: str, runs: int, root: Path) -> list[dict]:
    from airflow_provider_batchinfer.launchers import embedded_ray, warm_runtime
    from airflow_provider_batchinfer.launchers.procs import free_ports
    from benchmarks.idle import wait_for_idle
    from tests.airflow_services import AirflowServices, services_env

    home = root / f"{dag_id}-{mode.replace(' ', '-')}"
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
            warm_runtime.ENABLE_ENV: flag,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
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
            if flag == "1":
                warm_runtime.wait_ready(ray_dir / "spares", timeout=120)
            settled = wait_for_idle()
            load = os.getloadavg()[0]
            timed.append({**_run_once(services, dag_id, task_id, conf), "settled_s": settled, "load1": load})
            print(f"  {mode:10s} {dag_id:30s} {timed[-1]}", flush=True)
    finally:
        services.stop()
        for spares in (ray_dir / "spares").glob("*"):
            warm_runtime.stop_spares(spares)
        embedded_ray.shutdown(ray_dir)
        shutil.rmtree(ray_dir, ignore_errors=True)
    return timed


def summarize(by_workload: dict[str, dict[str, list[dict]]]) -> dict:
    summary = {}
    for dag_id, by_mode in by_workload.items():
        on = [r["task_s"] for r in by_mode["spares on"]]
        off = [r["task_s"] for r in by_mode["spares off"]]
        median_on, median_off = statistics.median(on), statistics.median(off)
        summary[dag_id] = {
            "task_s_median_spares_on": median_on,
            "task_s_median_spares_off": median_off,
            "saving_fraction": round((median_off - median_on) / median_off, 3),
            "run_s_median_spares_on": statistics.median(r["run_s"] for r in by_mode["spares on"]),
            "run_s_median_spares_off": statistics.median(r["run_s"] for r in by_mode["spares off"]),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated DAG ids")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mechanisms.json"))
    args = parser.parse_args()
    by_workload: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bi-mech-") as tmp:
        for dag_id in args.only.split(","):
            by_workload[dag_id] = {
                mode: measure(dag_id, mode, flag, args.runs, Path(tmp)) for mode, flag in MODES.items()
            }
    report = {
        "what": "scoring task wall time (TI start to end) on a real scheduler + LocalExecutor worker, embedded default",
        "cores": os.cpu_count(),
        "runs": by_workload,
        "summary": summarize(by_workload),
    }
    out = Path(args.out)
    earlier = json.loads(out.read_text()) if out.exists() else {}
    for key in ("runs", "summary"):  # a run of some workloads keeps the others' latest figures
        report[key] = {**earlier.get(key, {}), **report[key]}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
