"""DAGs the batch runs pages are checked on (tests/services/test_airflow_services.py): one run with
dead-lettered rows into a run directory, one into an Iceberg table. Both on the services' Ray
cluster through a connection with prices, so their runs have a cost."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec, SaveMode

START = pendulum.datetime(2026, 11, 1, tz="UTC")

with DAG(
    "bi_ui_dead_letters",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"input": "", "out": ""},
    default_args={"retries": 0},
) as bi_ui_dead_letters:
    BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input="{{ params.input }}",
        output_spec=OutputSpec(stage_location="{{ params.out }}", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(max_batch_rows=20, on_error="dead_letter", max_error_fraction=0.5),
        model_service_conn_id="batchinfer_ui",
        poll_interval=1,
    )

with DAG(
    "bi_ui_iceberg",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"input": ""},
    default_args={"retries": 0},
) as bi_ui_iceberg:
    BatchInferenceOperator(
        task_id="score",
        model="text_length",
        version="v1",
        input="{{ params.input }}",
        output_spec=OutputSpec(table="ui.ticket_lengths", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(max_batch_rows=50),
        model_service_conn_id="batchinfer_ui",
        poll_interval=1,
    )
