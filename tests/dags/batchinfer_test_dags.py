"""DAGs the tests drive with dag.test(); every location comes in through params (run_conf)."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec, SaveMode, SuccessMarkerSensor

START = pendulum.datetime(2026, 1, 1, tz="UTC")
PARAMS = {"input": "", "out": "", "model": "text_length", "version": "v1"}


def _inference_dag(dag_id: str, mode: SaveMode, retries: int = 0, **operator_kwargs) -> DAG:
    with DAG(
        dag_id,
        schedule=None,
        start_date=START,
        params=dict(PARAMS),
        catchup=False,
        default_args={"retries": retries, "retry_delay": timedelta(seconds=0)},
    ) as dag:
        BatchInferenceOperator(
            task_id="infer",
            model="{{ params.model }}",
            version="{{ params.version }}",
            input="{{ params.input }}",
            output_spec=OutputSpec(stage_location="{{ params.out }}", mode=mode),
            **{"job_spec": JobSpec(max_batch_rows=100, progress_interval_s=2), **operator_kwargs},
        )
    return dag


bi_test_error_mode = _inference_dag("bi_test_error_mode", SaveMode.ERROR)
bi_test_overwrite_retry = _inference_dag("bi_test_overwrite_retry", SaveMode.OVERWRITE, retries=1)
bi_test_error_mode_retry = _inference_dag("bi_test_error_mode_retry", SaveMode.ERROR, retries=1)
# The same job always on the actor pool (a small input would otherwise be scored in the driver)
bi_test_on_pool = _inference_dag(
    "bi_test_on_pool", SaveMode.ERROR, job_spec=JobSpec(max_batch_rows=100, progress_interval_s=2, in_driver_max_rows=0)
)
bi_test_ray_jobs_timeout = _inference_dag(
    "bi_test_ray_jobs_timeout", SaveMode.ERROR, deferrable=True, poll_interval=1, job_timeout=4
)

with DAG("bi_test_sql_input", schedule=None, start_date=START, params={"out": ""}, catchup=False) as bi_test_sql_input:
    BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        sql="SELECT id AS ticket_id, body AS text FROM tickets ORDER BY id",
        conn_id="bi_test_sqlite",
        materialize_chunk_rows=100,
        output_spec=OutputSpec(stage_location="{{ params.out }}"),
    )

with DAG(
    "bi_test_sensor_poke", schedule=None, start_date=START, params={"location": ""}, catchup=False
) as bi_test_sensor_poke:
    SuccessMarkerSensor(task_id="gate", location="{{ params.location }}", poke_interval=1, timeout=3)

with DAG(
    "bi_test_sensor_deferrable", schedule=None, start_date=START, params={"location": ""}, catchup=False
) as bi_test_sensor_deferrable:
    SuccessMarkerSensor(task_id="gate", location="{{ params.location }}", poke_interval=1, timeout=4, deferrable=True)

with DAG(
    "bi_test_base_location", schedule=None, start_date=START, params=dict(PARAMS), catchup=False
) as bi_test_base_location:
    BatchInferenceOperator(
        task_id="infer",
        model="{{ params.model }}",
        version="{{ params.version }}",
        input="{{ params.input }}",
        output_spec=OutputSpec(base_stage_location="{{ params.out }}", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(max_batch_rows=100, progress_interval_s=2),
    )
