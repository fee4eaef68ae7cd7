"""Iceberg tables as output and input (issue 17), on the embedded SQL catalog (SQLite + a local
warehouse under the stage root), with real Ray jobs driven through ``BatchInferenceOperator.execute``.

One module-scoped embedded default (stage, registry, catalog) holds one table that the tests grow
run by run: run keys are Airflow run ids, so each test adds or replaces a run and checks what every
other run key still holds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JobFile, Manifest
from airflow_provider_batchinfer.contract.tables import SUMMARY_PREFIX, TableInput, TableOutput
from airflow_provider_batchinfer.specs import OutputSpec, SaveMode, SpecError
from airflow_provider_batchinfer.tables import iceberg_input
from airflow_provider_batchinfer.tables.catalog import public_catalog
from tests.iceberg_support import SIGNATURE, data_files, operator, read_in_fresh_process
from tests.runs import job_file, manifest_for
from tests.task_context import TaskInstanceStandIn

from airflow.sdk.exceptions import AirflowFailException  # isort: skip

TABLE = "ml.ticket_scores"


def slow(test):
    return pytest.mark.slow(pytest.mark.usefixtures("airflow_db", "ray_cluster")(test))


def ti(run_id: str, try_number: int = 1) -> TaskInstanceStandIn:
    return TaskInstanceStandIn(dag_id="bi_iceberg", run_id=run_id, try_number=try_number)


# --- parse time and the contract (no Ray, no Airflow run) ------------------------------------------------


def test_table_specs_are_checked_when_the_dag_is_parsed():
    assert OutputSpec(table=TABLE, mode="overwrite").to_dict()["table"] == TABLE
    assert OutputSpec(table="{{ params.table }}").table == "{{ params.table }}"  # rendered later
    with pytest.raises(SpecError, match="'scores' is not an Iceberg table name; write '<namespace>.<table>'"):
        OutputSpec(table="scores")
    with pytest.raises(SpecError, match="SaveMode.RESUME is for directory outputs"):
        OutputSpec(table=TABLE, mode=SaveMode.RESUME)
    with pytest.raises(SpecError, match="drop stage_location"):
        OutputSpec(table=TABLE, stage_location="/tmp/x")
    for bad, message in (
        ("iceberg://raw.tickets?snapshot_id=abc", "snapshot_id must be a whole number"),
        ("iceberg://raw.tickets?when=now", r"unknown parameter\(s\) \['when'\]"),
        ("iceberg://raw.tickets?row_filter=day%20%3D%3D", "is not a pyiceberg filter expression"),
        ("iceberg://tickets", "is not an Iceberg table name"),
    ):
        with pytest.raises(SpecError, match=message):
            operator(TABLE, bad)
    uri = iceberg_input("raw.tickets", snapshot_id=7, row_filter="day = 'd1'")
    assert uri == "iceberg://raw.tickets?snapshot_id=7&row_filter=day+%3D+%27d1%27"
    assert operator(TABLE, uri).input == uri


def test_table_sections_round_trip_through_the_job_file_and_manifest(tmp_path):
    target = TableOutput(TABLE, {"name": "batchinfer", "type": "sql"}, "run1", "overwrite", "/claims/run1", "/wh/t")
    source = TableInput("raw.tickets", {"name": "batchinfer"}, 42, "day = 'd1'")
    job = JobFile.from_dict({**job_file(tmp_path).to_dict(), "table_output": target.to_dict()})
    assert job.table_output == target and job.table_input is None
    manifest = manifest_for(tmp_path, ())
    data = {**manifest.to_dict(), "table": target.with_snapshot(9).to_dict(), "table_input": source.to_dict()}
    back = Manifest.from_dict(data)
    assert back.table is not None and back.table.snapshot_id == 9 and back.table_input == source
    assert "table" not in manifest.to_dict()  # directory manifests are unchanged
    assert public_catalog(
        {"name": "c", "token": "t0k", "uri": "postgresql://u:pw@db/x", "s3.secret-access-key": "k"}
    ) == {
        "name": "c",
        "uri": "postgresql://u:***@db/x",
    }


# --- runs on the session's Ray ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One embedded default for the module: registry with two models, 300 tickets in 3 files."""
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import SlowLength, TextLength, write_tickets

    root = tmp_path_factory.mktemp("iceberg")
    old = os.environ.get("BATCHINFER_HOME")
    os.environ["BATCHINFER_HOME"] = str(root / "home")
    registry = ModelRegistry(str(root / "home" / "registry"))
    registry.log_model("text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE)
    registry.log_model("slow_length", "v1", "python", python_class=SlowLength, signature=SIGNATURE)
    inputs = write_tickets(root / "input", rows=300, files=3)
    yield {"root": root, "inputs": inputs, "home": root / "home"}
    if old is None:
        os.environ.pop("BATCHINFER_HOME", None)
    else:
        os.environ["BATCHINFER_HOME"] = old


def _catalog(world):
    from airflow_provider_batchinfer.tables.catalog import embedded_catalog, open_catalog

    props = embedded_catalog(str(world["home"] / "stage"), str(world["home"]))
    return props, open_catalog(props)


@slow
def test_a_run_commits_one_snapshot_that_every_reader_sees(world):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.markers import read_valid_manifest
    from airflow_provider_batchinfer.operators.table_io import read_options

    xcom = operator(TABLE, world["inputs"]).execute({"ti": ti("run1")})
    props, catalog = _catalog(world)
    table = catalog.load_table(TABLE)
    snapshots = table.metadata.snapshots
    assert len(snapshots) == 1 and xcom["snapshot_id"] == snapshots[0].snapshot_id
    summary = snapshots[0].summary
    assert summary["operation"].value == "append"
    assert summary["added-records"] == "300" and summary[SUMMARY_PREFIX + "run-key"] == "run1"
    assert {k: summary[SUMMARY_PREFIX + k] for k in ("attempt", "model.name", "model.version", "output-rows")} == {
        "attempt": xcom["attempt"],
        "model.name": "text_length",
        "model.version": "v1",
        "output-rows": "300",
    }
    assert summary[SUMMARY_PREFIX + "model.sha256"] == xcom["sha256"] and summary[SUMMARY_PREFIX + "run-id"] == "run1"
    assert xcom["output_location"] == f"iceberg://{TABLE}/run1" and xcom["rows"] == 300
    # every data file the snapshot references lies in this attempt's directory under the table
    files = data_files(table)
    assert {Path(p).parent.name for p in files} == {xcom["attempt"]} and set(files.values()) == {"run1"}
    assert all(p.startswith(table.location() + "/data/batchinfer_run_key=run1/") for p in files)

    # the sensor's check and read_committed: exactly this run's rows
    hook = ModelServiceHook()
    manifest = read_valid_manifest(xcom["output_location"], read_options(hook), verify_checksums=True)
    assert manifest is not None and manifest.table is not None and manifest.table.snapshot_id == xcom["snapshot_id"]
    rows = hook.read_committed(manifest.to_dict())
    assert sorted(rows.column("ticket_id").to_pylist()) == list(range(300))
    assert set(rows.column("batchinfer_model_version").to_pylist()) == {"v1"}
    expected = {r["ticket_id"]: len(r["text"]) for r in pq.read_table(world["inputs"]).to_pylist()}
    assert dict(zip(rows.column("ticket_id").to_pylist(), rows.column("length").to_pylist(), strict=True)) == expected

    # an independent reader: plain pyiceberg in a fresh process, counted by DuckDB
    seen = read_in_fresh_process(props, TABLE, "run1", xcom["snapshot_id"])
    assert seen["rows"] == 300 and seen["ids"] == list(range(300)) and seen["sum_length"] == sum(expected.values())

    # SaveMode.ERROR with the same run key: refused before anything is written
    attempts = set(os.listdir(Path(table.location().removeprefix("file://")) / "data" / "batchinfer_run_key=run1"))
    with pytest.raises(AirflowFailException, match=r"already holds 300 row\(s\) of run key run1 .* SaveMode.ERROR"):
        operator(TABLE, world["inputs"]).execute({"ti": ti("run1", try_number=2)})
    table = catalog.load_table(TABLE)
    assert len(table.metadata.snapshots) == 1
    assert (
        set(os.listdir(Path(table.location().removeprefix("file://")) / "data" / "batchinfer_run_key=run1")) == attempts
    )
