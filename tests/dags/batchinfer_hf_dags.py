"""DAGs for the transformers_pipeline and MLflow tests (tests/e2e/test_flavors_hf.py, tests/e2e/test_mlflow_models.py):
every input location from params (run_conf)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec

START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG(
    "bi_test_hf_pipelines",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"text_input": "", "audio_input": ""},
) as bi_test_hf_pipelines:
    BatchInferenceOperator(
        task_id="classify",
        model="text_classification",
        version="v1",
        input="{{ params.text_input }}",
        input_spec=InputSpec(id_column="id"),
        output_spec=OutputSpec(base_stage_location="labels"),
        job_spec=JobSpec(max_batch_rows=64, progress_interval_s=2),
    )
    # audio files on the stage, read by the replicas: column_handling turns each path into its bytes
    BatchInferenceOperator(
        task_id="transcribe",
        model="automatic_speech_recognition",
        version="v1",
        input="{{ params.audio_input }}",
        input_spec=InputSpec(id_column="id", column_mapping={"path": "audio"}, column_handling={"path": "bytes"}),
        output_spec=OutputSpec(base_stage_location="transcripts"),
        job_spec=JobSpec(max_batch_rows=8, progress_interval_s=2),
    )

with DAG(
    "bi_test_mlflow_models",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"tabular_input": ""},
) as bi_test_mlflow_models:
    BatchInferenceOperator(
        task_id="score_pyfunc",
        model="ridge",
        version="champion",
        input="{{ params.tabular_input }}",
        input_spec=InputSpec(id_column="id"),
        output_spec=OutputSpec(base_stage_location="ridge"),
        job_spec=JobSpec(max_batch_rows=1000, progress_interval_s=2),
    )
