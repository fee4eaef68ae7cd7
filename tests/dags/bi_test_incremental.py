"""The incremental-scoring DAG of tests/e2e/test_incremental.py: one task that reuses the predictions of
unchanged rows from the newest earlier run under ``params.base`` and dead-letters rows it cannot score."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode

with DAG(
    "bi_test_incremental",
    schedule=None,
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    params={"input": "", "base": ""},
    default_args={"retries": 0},
) as bi_test_incremental:
    BatchInferenceOperator(
        task_id="embed",
        model="products",
        version="v1",
        input="{{ params.input }}",
        input_spec=InputSpec(id_column="product_id"),
        output_spec=OutputSpec(base_stage_location="{{ params.base }}", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(reuse="unchanged", on_error="dead_letter", max_batch_rows=200, progress_interval_s=5),
    )
