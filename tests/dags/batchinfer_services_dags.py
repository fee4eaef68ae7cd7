"""DAGs for the real-services tests (tests/services/test_airflow_services.py). The services parse
this file, the asset pair's and the embeddings example, and no other: every DAG a scenario runs
is in one of them."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_batchinfer import (
    BatchInferenceOperator,
    InputSpec,
    JobSpec,
    OutputSpec,
    SaveMode,
    SuccessMarkerSensor,
)

START = pendulum.datetime(2026, 11, 1, tz="UTC")
# The daily DAGs end here: the services run the scheduler's own scheduling (asset-triggered runs
# need it), and a clock-scheduled DAG whose end_date has passed gets no run from it, while a
# backfill of the dates up to END still runs (a task of a later date would not: it is past the
# DAG's end). Every date a test backfills is at most END.
END = pendulum.datetime(2026, 11, 5, tz="UTC")

# a scheduled DAG in ERROR mode: a backfill re-run over committed dates must be refused
with DAG(
    "bi_svc_error_daily",
    schedule="@daily",
    start_date=START,
    end_date=END,
    catchup=False,
    default_args={"retries": 0},
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
        # a progress line every second: the deferred task's log shows them while the job runs
        job_spec=JobSpec(max_batch_rows=50, progress_interval_s=1.0),
        model_service_conn_id="batchinfer_cluster",
        deferrable=True,
        poll_interval=2,
    )
    infer >> SuccessMarkerSensor(
        task_id="gate", location=infer.output["output_location"], deferrable=True, poke_interval=2, timeout=300
    )

# a daily DAG on the cluster for the backfill acceptance: up to 2 runs at once, each deferred while
# its job runs, so both jobs share the session's 2-CPU Ray cluster through the Jobs API
with DAG(
    "bi_svc_ray_jobs_daily",
    schedule="@daily",
    start_date=START,
    end_date=END,
    catchup=False,
    max_active_runs=2,
    default_args={"retries": 0},
) as bi_svc_ray_jobs_daily:
    BatchInferenceOperator(
        task_id="infer",
        model="slow_length",
        version="v1",
        input="{{ var.value.bi_svc_input }}",
        input_spec=InputSpec(id_column="ticket_id"),
        output_spec=OutputSpec(base_stage_location="svc/ray_jobs_daily", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(max_batch_rows=50),
        model_service_conn_id="batchinfer_cluster",
        deferrable=True,
        poll_interval=2,
    )

# an injected fault fails the first try; the scheduler's retry runs the job again and OVERWRITE
# leaves one clean result
with DAG(
    "bi_svc_retry",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"input": "", "out": ""},
    default_args={"retries": 1, "retry_delay": timedelta(seconds=0)},
) as bi_svc_retry:
    BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input="{{ params.input }}",
        output_spec=OutputSpec(stage_location="{{ params.out }}", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(max_batch_rows=100, progress_interval_s=2),
    )

with DAG(
    "bi_svc_sensor_wait", schedule=None, start_date=START, catchup=False, params={"location": ""}
) as bi_svc_sensor_wait:
    SuccessMarkerSensor(task_id="gate", location="{{ params.location }}", deferrable=True, poke_interval=1, timeout=180)
