"""``execute_complete`` validates the trigger's event before reading any of it, and the trigger
speaks the shared vocabulary."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowException

from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec
from airflow_provider_batchinfer.triggers.base import WatchStatus, WatchTrigger
from airflow_provider_batchinfer.triggers.ray_job import RayJobTrigger
from tests.task_context import TaskInstanceStandIn


def _operator(tmp_path) -> BatchInferenceOperator:
    return BatchInferenceOperator(
        task_id="infer",
        model="m",
        version="v1",
        input=str(tmp_path / "in"),
        output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
    )


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (None, "trigger event is missing or not a dict"),
        ({"status": "SUCCEEDED", "submission_id": "s"}, "unknown status 'SUCCEEDED'"),  # the old vocabulary
        ({"status": "success"}, r"lacks \['job_id', 'job_status'\]"),
    ],
)
def test_a_malformed_event_fails_before_anything_is_read(tmp_path, event, message):
    with pytest.raises(AirflowException, match=message):
        _operator(tmp_path).execute_complete({"ti": TaskInstanceStandIn()}, event)
    assert not (tmp_path / "out").exists()


def test_an_error_event_fails_the_task_with_the_watchers_message(tmp_path):
    event = {
        "status": WatchStatus.ERROR.value,
        "job_id": "sid",
        "submission_id": "sid",
        "job_status": "UNKNOWN",
        "message": "ConnectionError: refused",
    }
    with pytest.raises(AirflowException, match="watching job sid failed: ConnectionError: refused"):
        _operator(tmp_path).execute_complete({"ti": TaskInstanceStandIn()}, event)


def test_an_event_for_a_directory_without_its_job_file_fails_clearly(tmp_path, batchinfer_home):
    event = {"status": WatchStatus.SUCCESS.value, "job_id": "sid", "job_status": "SUCCEEDED"}
    with pytest.raises(AirflowException, match=r"_job.json is gone"):
        _operator(tmp_path).execute_complete({"ti": TaskInstanceStandIn()}, event)


def test_the_ray_job_trigger_shares_the_watch_base():
    trigger = RayJobTrigger(submission_id="sid", model_service_conn_id="c", poll_interval=3, deadline=100.0)
    assert isinstance(trigger, WatchTrigger)
    path, kwargs = trigger.serialize()
    assert path == "airflow_provider_batchinfer.triggers.ray_job.RayJobTrigger"
    assert RayJobTrigger(**kwargs).serialize() == (path, kwargs)
    with pytest.raises(ValueError, match="poll_interval must be > 0"):
        RayJobTrigger(submission_id="sid", model_service_conn_id="c", poll_interval=0)
    with pytest.raises(ValueError, match="needs a submission_id"):
        RayJobTrigger(submission_id="", model_service_conn_id="c")


def test_the_trigger_reports_an_unreachable_cluster_as_an_error_event(monkeypatch):
    import asyncio
    import json

    from tests.conftest import _free_port

    monkeypatch.setenv(
        "AIRFLOW_CONN_BI_DEAD",
        json.dumps(
            {"conn_type": "batchinfer", "host": f"http://127.0.0.1:{_free_port()}", "extra": {"launcher": "ray_jobs"}}
        ),
    )
    trigger = RayJobTrigger(submission_id="sid", model_service_conn_id="bi_dead", poll_interval=1)

    async def first():
        async for event in trigger.run():
            return event.payload

    payload = asyncio.run(first())
    assert (
        payload["status"] == "error"
        and payload["job_id"] == "sid"
        and "cannot reach the Ray Jobs API" in payload["message"]
    )
