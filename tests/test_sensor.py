"""SuccessMarkerSensor and its trigger on a real stage: waits without a marker, fails on a marker
whose manifest does not hold, passes with a valid one (poke, deferrable, and through dag.test)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from airflow_provider_batchinfer.stage import SUCCESS_MARKER, Stage
from tests.conftest import run_dag, xcom_value


def commit(run_dir, rows: int = 3, size_ok: bool = True) -> dict:
    """A committed run directory as the runtime leaves it: one part and a manifest listing it."""
    run = Stage.open(str(run_dir))
    run.child("part-00000-t01abc.parquet").write_bytes(b"x" * 10)
    manifest = {
        "format": "batchinfer.manifest/1",
        "run_dir": str(run_dir),
        "files": [{"name": "part-00000-t01abc.parquet", "size": 10 if size_ok else 11, "rows": rows}],
        "counts": {"input_rows": rows, "output_rows": rows, "error_rows": 0},
        "model": {"name": "m", "version": "v1", "sha256": "0" * 64},
    }
    run.child(SUCCESS_MARKER).write_json(manifest)
    return manifest


def _sensor(location, **kwargs):
    from airflow_provider_batchinfer.sensors.success_marker import SuccessMarkerSensor

    return SuccessMarkerSensor(task_id="gate", location=str(location), **kwargs)


def test_poke_waits_then_passes_with_the_manifest(tmp_path):
    sensor = _sensor(tmp_path / "run")
    assert sensor.poke({}).is_done is False
    manifest = commit(tmp_path / "run")
    result = sensor.poke({})
    assert result.is_done and result.xcom_value == manifest


def test_poke_fails_at_once_on_a_marker_whose_files_are_missing(tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    commit(tmp_path / "run")
    (tmp_path / "run" / "part-00000-t01abc.parquet").unlink()
    with pytest.raises(AirflowFailException, match="part-00000-t01abc.parquet is listed in _SUCCESS but missing"):
        _sensor(tmp_path / "run").poke({})
    commit(tmp_path / "run", size_ok=False)
    with pytest.raises(AirflowFailException, match="is 10 bytes but _SUCCESS says 11"):
        _sensor(tmp_path / "run").poke({})


def test_trigger_serializes_and_fires_once_the_marker_is_valid(tmp_path):
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger

    trigger = SuccessMarkerTrigger(location=str(tmp_path / "run"), poke_interval=0.2)
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_provider_batchinfer.triggers.success_marker.SuccessMarkerTrigger"
    assert SuccessMarkerTrigger(**kwargs).serialize() == (classpath, kwargs)

    async def wait_for_event():
        gen = trigger.run()
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.5)
        assert not task.done()  # no marker yet: still waiting, and the loop is free to run this
        await asyncio.to_thread(commit, tmp_path / "run")
        return await asyncio.wait_for(task, timeout=30)

    event = asyncio.run(wait_for_event())
    assert event.payload["status"] == "success"
    assert event.payload["manifest"]["counts"]["output_rows"] == 3


def test_trigger_reports_an_invalid_manifest_as_an_error_event(tmp_path):
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger

    commit(tmp_path / "run")
    (tmp_path / "run" / "part-00000-t01abc.parquet").unlink()
    trigger = SuccessMarkerTrigger(location=str(tmp_path / "run"), poke_interval=0.2)
    event = asyncio.run(trigger.run().__anext__())
    assert event.payload["status"] == "error" and "missing" in event.payload["message"]
    with pytest.raises(ValueError, match="poke_interval must be > 0"):
        SuccessMarkerTrigger(location="x", poke_interval=0)


@pytest.mark.slow
@pytest.mark.usefixtures("airflow_db")
class TestSensorInDags:
    def test_poke_mode_times_out_without_a_marker(self, tmp_path):
        state, tasks, _ = run_dag("bi_test_sensor_poke", location=str(tmp_path / "run"))
        assert state == "failed" and tasks["gate"][0] == "failed"

    def test_poke_mode_passes_and_pushes_the_manifest(self, tmp_path):
        manifest = commit(tmp_path / "run")
        state, tasks, run_id = run_dag("bi_test_sensor_poke", location=str(tmp_path / "run"))
        assert state == "success"
        assert xcom_value("bi_test_sensor_poke", run_id, "gate") == manifest

    def test_poke_mode_fails_on_a_broken_manifest(self, tmp_path):
        commit(tmp_path / "run", size_ok=False)
        state, tasks, _ = run_dag("bi_test_sensor_poke", location=str(tmp_path / "run"))
        assert state == "failed"

    def test_deferrable_waits_in_the_trigger_then_passes(self, tmp_path):
        def later():
            time.sleep(1.5)
            commit(tmp_path / "run", rows=7)

        writer = threading.Thread(target=later)
        writer.start()
        state, tasks, run_id = run_dag("bi_test_sensor_deferrable", location=str(tmp_path / "run"))
        writer.join()
        assert state == "success", tasks
        assert xcom_value("bi_test_sensor_deferrable", run_id, "gate")["counts"]["output_rows"] == 7

    def test_deferrable_times_out_without_a_marker(self, tmp_path):
        state, tasks, _ = run_dag("bi_test_sensor_deferrable", location=str(tmp_path / "never"))
        assert state == "failed"
