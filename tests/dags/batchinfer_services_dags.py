"""DAGs for the real-services tests (tests/test_airflow_services.py)."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec, SaveMode, SuccessMarkerSensor

START = pendulum.datetime(2026, 11, 1, tz="UTC")

# a scheduled DAG in ERROR mode: a backfill re-run over committed dates must be refused
with DAG(
    "bi_svc_error_daily", schedule="@daily", start_date=START, catchup=False, default_args={"retries": 0}
) as bi_svc_error_daily:
    BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input="{{ var.value.bi_svc_input }}",
        output_spec=OutputSpec(base_stage_location="svc/error_daily", mode=SaveMode.ERROR),
    )

# the cluster path: inference submitted to the Ray Jobs API and awaited in the triggerer, then a
# deferrable sensor
with DAG(
    "bi_svc_ray_jobs",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"input": "", "out": ""},
    default_args={"retries": 0, "retry_delay": timedelta(seconds=1)},
) as bi_svc_ray_jobs:
    infer = BatchInferenceOperator(
        task_id="infer",
        model="slow_length",
        version="v1",
        input="{{ params.input }}",
        output_spec=OutputSpec(stage_location="{{ params.out }}"),
        job_spec=JobSpec(max_batch_rows=50),
        model_service_conn_id="batchinfer_cluster",
        deferrable=True,
        poll_interval=2,
    )
    infer >> SuccessMarkerSensor(
        task_id="gate", location=infer.output["output_location"], deferrable=True, poke_interval=2, timeout=300
    )

with DAG(
    "bi_svc_sensor_wait", schedule=None, start_date=START, catchup=False, params={"location": ""}
) as bi_svc_sensor_wait:
    SuccessMarkerSensor(task_id="gate", location="{{ params.location }}", deferrable=True, poke_interval=1, timeout=180)
