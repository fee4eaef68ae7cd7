"""SuccessMarkerSensor and its trigger on a real stage: waits without a marker, fails on a marker
whose manifest does not hold (missing or resized files, forged parts, a part with one flipped byte,
a minimal manifest), passes with a valid one (poke, deferrable, and through dag.test), and hashes
the output once per marker."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, ManifestError
from airflow_provider_batchinfer.store.committed import read_committed
from tests.conftest import run_dag, xcom_value
from tests.runs import committed_run, parquet_bytes

PART = "part-00000-t01abc.parquet"


def commit(run_dir, rows: int = 3, size_ok: bool = True) -> dict:
    """A committed run directory as the runtime leaves it: one real part and a manifest listing it
    (with ``size_ok=False`` the manifest records one byte more than the part holds). Returns what
    the sensor pushes to XCom: the manifest's dict."""
    manifest = committed_run(Path(run_dir), rows=rows, attempt="t01abc")
    if not size_ok:
        entry = dataclasses.replace(manifest.files[0], size=manifest.files[0].size + 1)
        manifest = dataclasses.replace(manifest, files=(entry,))
        (Path(run_dir) / SUCCESS_MARKER).write_text(manifest.to_json())
    return manifest.to_dict()


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
    (tmp_path / "run" / PART).unlink()
    with pytest.raises(AirflowFailException, match=f"{PART} is listed in _SUCCESS but missing"):
        _sensor(tmp_path / "run").poke({})
    size = commit(tmp_path / "run", size_ok=False)["files"][0]["size"] - 1
    with pytest.raises(AirflowFailException, match=f"is {size} bytes but _SUCCESS says {size + 1}"):
        _sensor(tmp_path / "run").poke({})


def test_a_part_overwritten_with_garbage_of_the_same_size_fails_the_sensor(tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    size = commit(tmp_path / "run")["files"][0]["size"]
    (tmp_path / "run" / PART).write_bytes(b"\x00" * size)
    with pytest.raises(AirflowFailException, match=f"{PART} is not a readable Parquet file .* re-run the task"):
        _sensor(tmp_path / "run").poke({})


def test_a_minimal_manifest_fails_with_a_clear_message_not_a_key_error(tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    manifest = commit(tmp_path / "run")
    minimal = {k: manifest[k] for k in ("format", "run_dir", "files", "counts")}
    (tmp_path / "run" / SUCCESS_MARKER).write_text(json.dumps(minimal))
    with pytest.raises(
        AirflowFailException,
        match=r"has a _SUCCESS marker that does not hold: .*_SUCCESS has no "
        r"'job'\. Waiting will not fix it",
    ):
        _sensor(tmp_path / "run").poke({})


def test_a_forged_part_with_a_valid_footer_fails_unless_checksums_are_opted_out(tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    manifest = commit(tmp_path / "run")
    forged = parquet_bytes([0, 1, 2], scores=[0.0, 1.0, 1.5])  # same size, same rows, other bytes
    assert len(forged) == manifest["files"][0]["size"]
    (tmp_path / "run" / PART).write_bytes(forged)
    with pytest.raises(AirflowFailException, match=f"{PART} does not match its sha256 in _SUCCESS"):
        _sensor(tmp_path / "run").poke({})
    assert _sensor(tmp_path / "run", verify_checksums=False).poke({}).is_done
    # and publish, reading the XCom dict, refuses it by default
    with pytest.raises(ManifestError, match="does not match its sha256"):
        read_committed(manifest)


def test_one_flipped_byte_in_a_data_page_fails_the_default_sensor_and_trigger(tmp_path):
    """Size and footer stay intact (the part still reads as 3 rows): only its sha256 can tell."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger
    from tests.damage import flip_data_page_byte

    manifest = commit(tmp_path / "run")
    flip_data_page_byte(tmp_path / "run" / PART)
    assert (tmp_path / "run" / PART).stat().st_size == manifest["files"][0]["size"]
    with pytest.raises(AirflowFailException, match=f"{PART} does not match its sha256 in _SUCCESS.*re-run the task"):
        _sensor(tmp_path / "run").poke({})
    event = asyncio.run(SuccessMarkerTrigger(location=str(tmp_path / "run"), poll_interval=0.2).run().__anext__())
    assert event.payload["status"] == "failed" and f"{PART} does not match its sha256" in event.payload["message"]
    assert _sensor(tmp_path / "run", verify_checksums=False).poke({}).is_done  # the opt-out sees names and footers


def test_the_output_is_hashed_once_per_marker_and_again_when_the_marker_changes(tmp_path, monkeypatch):
    """Bytes read from the part, counted under the filesystem: the first poke reads all of it (the
    hash and the footer), a second poke of the same marker none of it; a rewritten marker is hashed
    again."""
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger
    from tests.damage import count_reads

    size = commit(tmp_path / "run")["files"][0]["size"]
    part = str(tmp_path / "run" / PART)
    reads = count_reads(monkeypatch)
    assert _sensor(tmp_path / "run").poke({}).is_done
    first, reads[part] = reads[part], 0
    assert first >= size  # every byte, once for the hash (plus the footer)
    assert _sensor(tmp_path / "run").poke({}).is_done  # another sensor object, same process
    again, reads[part] = reads[part], 0
    assert again == 0  # names and sizes come from the listing: no request per part
    trigger = SuccessMarkerTrigger(location=str(tmp_path / "run"), poll_interval=0.2)
    assert asyncio.run(trigger.run().__anext__()).payload["status"] == "success"
    assert reads[part] == 0
    reads[part] = 0
    marker = tmp_path / "run" / SUCCESS_MARKER
    marker.write_text(json.dumps(json.loads(marker.read_text())))  # same manifest, other bytes
    assert _sensor(tmp_path / "run").poke({}).is_done
    assert reads[part] >= size


def test_a_marker_beside_a_newer_claim_fails_the_sensor(tmp_path):
    """On S3 a zombie's marker can be visible for a moment beside the newer try's claim before the
    zombie withdraws it: a marker whose attempt is not the one ``_job.json`` names is not this run's."""
    from airflow.sdk.exceptions import AirflowFailException

    commit(tmp_path / "run")
    claim = tmp_path / "run" / "_job.json"
    claim.write_text(json.dumps({"attempt": "t01abc"}))
    assert _sensor(tmp_path / "run").poke({}).is_done
    claim.write_text(json.dumps({"attempt": "t02new"}))
    with pytest.raises(
        AirflowFailException, match="committed by attempt t01abc, but the run directory is claimed by attempt t02new"
    ):
        _sensor(tmp_path / "run", verify_checksums=False).poke({})


def test_an_iceberg_runs_files_are_hashed_once_per_snapshot_manifest(tmp_path, monkeypatch):
    """The table side: the snapshot's manifest is the marker. The catalog lookup is stood in for (the
    Iceberg tests run it for real); what is checked here is the hashing and its verdict."""
    from airflow_provider_batchinfer.store.commit.verdicts import Verdicts
    from airflow_provider_batchinfer.store.committed import read_valid_manifest
    from airflow_provider_batchinfer.store.iceberg import read as table_read
    from tests.damage import count_reads, flip_data_page_byte

    manifest = committed_run(tmp_path / "run", attempt="t01abc")
    asked: list[bool] = []

    def snapshot_manifest(location, options, *, verify_checksums=False):
        asked.append(verify_checksums)
        return manifest

    monkeypatch.setattr(table_read, "read_table_manifest", snapshot_manifest)
    monkeypatch.setattr(table_read, "split_options", lambda options: ({}, None))
    roots = {table_read.ROOTS_OPTION: {"stage_root": str(tmp_path)}}  # the connection's: the run lies below them
    part, size = str(tmp_path / "run" / PART), manifest.files[0].size
    reads, verdicts = count_reads(monkeypatch), Verdicts()
    for _ in range(2):
        assert read_valid_manifest("iceberg://ns.t/run1", roots, verify_checksums=True, verdicts=verdicts) == manifest
    assert reads[part] == size and asked == [False, False]  # hashed once, by the verdict's caller
    flip_data_page_byte(tmp_path / "run" / PART)
    with pytest.raises(ManifestError, match=f"{PART} does not match its sha256"):
        read_valid_manifest("iceberg://ns.t/run1", roots, verify_checksums=True, verdicts=Verdicts())


def test_a_marker_naming_another_run_directory_fails_the_sensor(tmp_path):
    """Readers open the files under the manifest's ``run_dir``: a marker copied (or forged) into a
    directory it was not committed in must not send ``publish`` to files the sensor never checked."""
    import shutil

    from airflow.sdk.exceptions import AirflowFailException

    commit(tmp_path / "elsewhere")
    shutil.copytree(tmp_path / "elsewhere", tmp_path / "run")
    with pytest.raises(
        AirflowFailException,
        match=rf"was written for the run directory {tmp_path / 'elsewhere'}, not {tmp_path / 'run'}; a marker only",
    ):
        _sensor(tmp_path / "run").poke({})
    # the same directory spelled with a trailing slash or file:// is the same directory
    assert _sensor(f"{tmp_path / 'elsewhere'}/").poke({}).is_done
    assert _sensor(f"file://{tmp_path / 'elsewhere'}").poke({}).is_done


def test_deferrable_defaults_to_the_airflow_setting():
    import inspect

    from airflow.sdk.configuration import conf

    from airflow_provider_batchinfer.sensors.success_marker import SuccessMarkerSensor

    default = inspect.signature(SuccessMarkerSensor.__init__).parameters["deferrable"].default
    assert default is conf.getboolean("operators", "default_deferrable", fallback=False)
    assert _sensor("/x").deferrable is default
    assert _sensor("/x", deferrable=True).deferrable is True


def test_trigger_serializes_and_fires_once_the_marker_is_valid(tmp_path):
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger

    trigger = SuccessMarkerTrigger(location=str(tmp_path / "run"), poke_interval=0.2)
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_provider_batchinfer.triggers.success_marker.SuccessMarkerTrigger"
    assert SuccessMarkerTrigger(**kwargs).serialize() == (classpath, kwargs)
    assert kwargs["poll_interval"] == 0.2 and kwargs["verify_checksums"] is True

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


def test_trigger_reports_an_invalid_manifest_as_a_failed_event(tmp_path):
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger

    commit(tmp_path / "run")
    (tmp_path / "run" / PART).unlink()
    trigger = SuccessMarkerTrigger(location=str(tmp_path / "run"), poke_interval=0.2)
    event = asyncio.run(trigger.run().__anext__())
    assert event.payload["status"] == "failed" and "missing" in event.payload["message"]
    with pytest.raises(ValueError, match="poke_interval must be > 0"):
        SuccessMarkerTrigger(location="x", poke_interval=0)
    with pytest.raises(ValueError, match="poll_interval must be > 0"):
        SuccessMarkerTrigger(location="x", poll_interval=0)


def test_trigger_verifies_checksums_unless_opted_out_and_times_out(tmp_path):
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger

    manifest = commit(tmp_path / "run")
    (tmp_path / "run" / PART).write_bytes(parquet_bytes([0, 1, 2], scores=[0.0, 1.0, 1.5]))
    assert len(parquet_bytes([0, 1, 2], scores=[0.0, 1.0, 1.5])) == manifest["files"][0]["size"]
    plain = SuccessMarkerTrigger(location=str(tmp_path / "run"), poll_interval=0.2, verify_checksums=False)
    assert asyncio.run(plain.run().__anext__()).payload["status"] == "success"
    checked = SuccessMarkerTrigger(location=str(tmp_path / "run"), poll_interval=0.2)
    event = asyncio.run(checked.run().__anext__()).payload
    assert event["status"] == "failed" and "sha256" in event["message"]
    late = SuccessMarkerTrigger(location=str(tmp_path / "never"), poll_interval=0.1, deadline=time.time() + 0.3)
    assert asyncio.run(late.run().__anext__()).payload == {"status": "timeout", "location": str(tmp_path / "never")}


def test_execute_complete_validates_the_event(tmp_path):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout

    sensor = _sensor(tmp_path / "run")
    manifest = commit(tmp_path / "run")
    location = str(tmp_path / "run")
    assert sensor.execute_complete({}, {"status": "success", "location": location, "manifest": manifest}) == manifest
    with pytest.raises(AirflowException, match="unknown status"):
        sensor.execute_complete({}, {"status": "SUCCEEDED", "location": location})
    with pytest.raises(AirflowException, match="lacks"):
        sensor.execute_complete({}, {"status": "success", "location": location})
    with pytest.raises(AirflowFailException, match="does not hold: .*_SUCCESS has no 'job'"):
        sensor.execute_complete(
            {},
            {"status": "success", "location": location, "manifest": {k: v for k, v in manifest.items() if k != "job"}},
        )
    with pytest.raises(AirflowFailException, match="does not hold: broken"):
        sensor.execute_complete({}, {"status": "failed", "location": location, "message": "broken"})
    with pytest.raises(AirflowSensorTimeout):
        sensor.execute_complete({}, {"status": "timeout", "location": location})
    with pytest.raises(AirflowException, match="could not check"):
        sensor.execute_complete({}, {"status": "error", "location": location, "message": "down"})


@pytest.mark.usefixtures("airflow_db")
class TestSensorInDags:
    def test_poke_mode_times_out_without_a_marker(self, tmp_path):
        state, tasks, _ = run_dag("bi_test_sensor_poke", location=str(tmp_path / "run"))
        assert state == "failed" and tasks["gate"][0] == "failed"

    def test_poke_mode_passes_and_pushes_the_manifest(self, tmp_path):
        manifest = commit(tmp_path / "run")
        state, _tasks, run_id = run_dag("bi_test_sensor_poke", location=str(tmp_path / "run"))
        assert state == "success"
        assert xcom_value("bi_test_sensor_poke", run_id, "gate") == manifest

    def test_poke_mode_fails_on_a_broken_manifest(self, tmp_path):
        commit(tmp_path / "run", size_ok=False)
        state, _tasks, _ = run_dag("bi_test_sensor_poke", location=str(tmp_path / "run"))
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
        state, _tasks, _ = run_dag("bi_test_sensor_deferrable", location=str(tmp_path / "never"))
        assert state == "failed"
