"""The asset pair the tests run: an inference DAG whose commits are Asset events, and a publish DAG
scheduled on that asset (``tests/e2e/test_assets.py`` with ``dag.test()``, ``tests/services/test_airflow_services.py``
with the real scheduler, which creates asset-triggered runs only with ``use_job_schedule`` on). Neither
is clock-scheduled, so that scheduling creates no run of them but the one an asset event triggers.
The producer scores with ``text_length`` v1 from the embedded default's registry
(``$BATCHINFER_HOME/registry``)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode
from airflow_provider_batchinfer.operators.assets import stage_asset

START = pendulum.datetime(2026, 11, 1, tz="UTC")
ASSET_LOCATION = "svc/assets"  # relative: under the connection's stage_root

with DAG(
    "bi_test_asset_producer",
    schedule=None,
    start_date=START,
    params={"input": ""},
    catchup=False,
    default_args={"retries": 0},
) as bi_test_asset_producer:
    BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input="{{ params.input }}",
        input_spec=InputSpec(id_column="ticket_id"),
        output_spec=OutputSpec(base_stage_location=ASSET_LOCATION, mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(max_batch_rows=100),
    )  # output_asset=True (the default): stage_asset(ASSET_LOCATION)

with DAG(
    "bi_test_asset_publisher",
    schedule=[stage_asset(ASSET_LOCATION)],
    start_date=START,
    catchup=False,
    default_args={"retries": 0},
) as bi_test_asset_publisher:

    @task
    def publish() -> str:
        """Copy exactly the committed rows of the run that triggered this DAG run, found through its
        asset event (no upstream run id needed), to ``svc/published/<run key>.parquet``."""
        import pyarrow.parquet as pq
        from airflow.sdk import get_current_context

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.operators.assets import read_triggering_run

        hook = ModelServiceHook()
        run, manifest = read_triggering_run(get_current_context(), hook.storage_options)
        table = hook.read_committed(manifest.to_dict())  # only the files _SUCCESS lists, checksums verified
        out = hook.open_stage("svc/published")
        out.fs.create_dir(out.path, recursive=True)
        target = out.child(run["run_dir"].rstrip("/").rsplit("/", 1)[-1] + ".parquet")
        with target.fs.open_output_stream(target.path) as sink:
            pq.write_table(table, sink)
        print(f"published {table.num_rows} rows of {run['run_dir']} (model {run['model']}/{run['model_version']})")
        return target.location

    publish()
