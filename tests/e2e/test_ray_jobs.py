"""The ray_jobs launcher against a real `ray start --head` cluster's Jobs API (on 127.0.0.1, with
token auth): kill, deferral timeout, unreachable cluster. Its other scenarios run where they meet
more claims at once: a deferrable example DAG on S3 (``test_s3.py``), a failing job
(``test_job_secrets.py``), re-attach after a lost or restarted worker (``test_reattach.py``)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER
from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher
from tests.conftest import run_dag
from tests.models import SlowLength, write_tickets
from tests.task_context import TaskInstanceStandIn

pytestmark = pytest.mark.usefixtures("airflow_db")


@pytest.fixture
def ray_jobs_conn(ray_cluster, batchinfer_home, monkeypatch):
    conn = {
        "conn_type": "batchinfer",
        "host": ray_cluster["dashboard"],
        "extra": {
            "launcher": "ray_jobs",
            "python": sys.executable,
            "ray_token": ray_cluster["token"],
            "stage_root": str(batchinfer_home / "stage"),
            "registry_root": str(batchinfer_home / "registry"),
        },
    }
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps(conn))
    return conn


@pytest.fixture
def launcher(ray_cluster):
    return RayJobsLauncher(ray_cluster["dashboard"], headers={"Authorization": f"Bearer {ray_cluster['token']}"})


@pytest.fixture
def slow_model(registry):
    return registry.log_model(
        "slow_length",
        "v1",
        "python",
        python_class=SlowLength,
        signature={"inputs": {"text": "string"}, "outputs": {"length": "int64"}},
    )


def _operator(tmp_path, rows=1000, **kwargs):
    from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec

    tickets = write_tickets(tmp_path / "input", rows=rows, files=2)
    return BatchInferenceOperator(
        task_id="infer",
        model=kwargs.pop("model", "slow_length"),
        version="v1",
        input=str(tickets),
        output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
        job_spec=JobSpec(max_batch_rows=50),
        poll_interval=0.5,
        **kwargs,
    )


def jobs_of_run(launcher, run_id):
    """The cluster's jobs for one run (by the metadata every submission carries), oldest first."""
    jobs = [j for j in launcher.client().list_jobs() if (j.metadata or {}).get("run_id") == run_id]
    return sorted(jobs, key=lambda j: j.start_time or 0)


def wait_for_job(launcher, run_id, timeout=90):
    """The submission id of the run's (first) job, once it was submitted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = jobs_of_run(launcher, run_id)
        if jobs:
            return jobs[0].submission_id
        time.sleep(0.3)
    raise AssertionError(f"no job of run {run_id} was submitted within {timeout}s")


def _wait_for_status(launcher, sid, wanted=("RUNNING",), timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = launcher.find(sid)
        if info and info["status"] in wanted:
            return info["status"]
        time.sleep(0.5)
    raise AssertionError(f"job {sid} never reached {wanted}: {launcher.find(sid)}")


def test_killing_the_task_stops_the_job(ray_jobs_conn, launcher, slow_model, tmp_path):
    from airflow.sdk.exceptions import AirflowException

    ti = TaskInstanceStandIn(run_id="manual__kill")
    op = _operator(tmp_path, rows=2000)
    errors = []

    def run():
        try:
            op.execute({"ti": ti})
        except AirflowException as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=run)
    worker.start()
    sid = wait_for_job(launcher, ti.run_id)
    _wait_for_status(launcher, sid)
    op.on_kill()
    worker.join(timeout=120)
    assert _wait_for_status(launcher, sid, ("STOPPED",)) == "STOPPED"
    assert errors and "ended STOPPED" in errors[0]
    assert not (tmp_path / "out" / SUCCESS_MARKER).exists()


def test_the_trigger_on_kill_stops_the_job(ray_jobs_conn, launcher, slow_model, tmp_path):
    from airflow_provider_batchinfer.triggers.ray_job import RayJobTrigger

    ti = TaskInstanceStandIn(run_id="manual__trigger_kill")
    op = _operator(tmp_path, rows=2000, deferrable=True)
    from airflow.sdk.exceptions import TaskDeferred

    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})
    trigger = deferred.value.trigger
    sid = wait_for_job(launcher, ti.run_id)
    assert isinstance(trigger, RayJobTrigger) and trigger.serialize()[1]["submission_id"] == sid
    asyncio.run(trigger.on_kill())
    assert _wait_for_status(launcher, sid, ("STOPPED",)) == "STOPPED"


def test_deferral_timeout_stops_the_job(ray_jobs_conn, launcher, slow_model, tmp_path):
    tickets = write_tickets(tmp_path / "input", rows=2000, files=2)
    out = tmp_path / "out"
    state, _tasks, run_id = run_dag("bi_test_ray_jobs_timeout", input=str(tickets), out=str(out), model="slow_length")
    assert state == "failed"
    sid = wait_for_job(launcher, run_id)
    assert _wait_for_status(launcher, sid, ("STOPPED",)) == "STOPPED"
    assert not (out / SUCCESS_MARKER).exists()


def test_an_unreachable_cluster_names_its_address(batchinfer_home, text_length_model, tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowException

    from tests.conftest import _free_port

    address = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCHINFER_DEFAULT",
        json.dumps({"conn_type": "batchinfer", "host": address, "extra": {"launcher": "ray_jobs"}}),
    )
    op = _operator(tmp_path, rows=10, model="text_length")
    with pytest.raises(AirflowException, match=f"cannot reach the Ray Jobs API at {address}"):
        op.execute({"ti": TaskInstanceStandIn(run_id="manual__unreachable")})
    assert not (tmp_path / "out").exists()
