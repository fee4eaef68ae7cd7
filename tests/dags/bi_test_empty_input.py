"""One DAG, one task per ``InputSpec(on_empty=...)`` over the same input, and the sensor a downstream
DAG would gate on behind the committing one (tests/e2e/test_empty_input.py). Every task may retry
twice: an input without rows must fail without using them."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, OutputSpec, SuccessMarkerSensor

with DAG(
    "bi_test_empty_input",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    params={"input": "", "out": ""},
    catchup=False,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=0)},
) as bi_test_empty_input:
    tasks = {
        on_empty: BatchInferenceOperator(
            task_id=f"on_empty_{on_empty}",
            model="text_length",
            version="v1",
            input="{{ params.input }}",
            input_spec=InputSpec(on_empty=on_empty),
            output_spec=OutputSpec(base_stage_location="{{ params.out }}/" + on_empty),
        )
        for on_empty in ("fail", "skip", "commit")
    }
    SuccessMarkerSensor(
        task_id="ready", location=tasks["commit"].output["output_location"], poke_interval=1, timeout=30
    )
