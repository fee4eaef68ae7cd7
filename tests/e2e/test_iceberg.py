"""Iceberg tables as output and input, on the embedded SQL catalog (SQLite + a local
warehouse under the stage root), with real Ray jobs driven through ``BatchInferenceOperator.execute``.

One module-scoped embedded default (stage, registry, catalog) holds one table that the tests grow
run by run: run keys are Airflow run ids, so each test adds or replaces a run and checks what every
other run key still holds.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JobFile, Manifest
from airflow_provider_batchinfer.contract.specs import OutputSpec, SaveMode, SpecError, iceberg_input
from airflow_provider_batchinfer.contract.tables import SUMMARY_PREFIX, TableInput, TableOutput
from airflow_provider_batchinfer.store.iceberg.catalog import public_catalog
from tests.iceberg_support import SIGNATURE, data_files, operator, read_in_fresh_process
from tests.runs import job_file, manifest_for
from tests.task_context import TaskInstanceStandIn

from airflow.sdk.exceptions import AirflowFailException  # isort: skip

TABLE = "ml.ticket_scores"


def slow(test):
    return pytest.mark.usefixtures("airflow_db")(test)


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


def test_the_connection_names_the_catalog_else_the_embedded_sqlite_one():
    from airflow_provider_batchinfer.store.iceberg.catalog import CatalogError, catalog_config

    local = catalog_config({}, "/data/stage", "/home/bi")
    assert local == {
        "name": "batchinfer",
        "type": "sql",
        "uri": "sqlite:////data/stage/_iceberg/catalog.db",
        "warehouse": "file:///data/stage/_iceberg/warehouse",
    }
    on_s3 = catalog_config({}, "s3://lake/stage", "/home/bi")
    assert on_s3["uri"] == "sqlite:////home/bi/iceberg/catalog.db"  # SQLite is a local file
    assert on_s3["warehouse"] == "s3://lake/stage/_iceberg/warehouse"
    rest = catalog_config({"iceberg_catalog": {"type": "rest", "uri": "https://cat:8181", "token": "t"}}, "/s", "/h")
    assert rest == {"type": "rest", "uri": "https://cat:8181", "token": "t", "name": "batchinfer"}
    assert "token" not in public_catalog(rest)
    with pytest.raises(CatalogError, match="iceberg_catalog extra is not a JSON object"):
        catalog_config({"iceberg_catalog": "{type: rest"}, "/s", "/h")
    with pytest.raises(CatalogError, match="must be an object of pyiceberg catalog properties with a type"):
        catalog_config({"iceberg_catalog": {"warehouse": "s3://x"}}, "/s", "/h")


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
    from airflow_provider_batchinfer.store.iceberg.catalog import embedded_catalog, open_catalog

    props = embedded_catalog(str(world["home"] / "stage"), str(world["home"]))
    return props, open_catalog(props)


@slow
def test_a_run_commits_one_snapshot_that_every_reader_sees(world):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    op = operator(TABLE, world["inputs"])
    xcom = op.execute({"ti": ti("run1")})
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
    manifest = read_valid_manifest(xcom["output_location"], hook.table_read_options(), verify_checksums=True)
    assert manifest is not None and manifest.table is not None and manifest.table.snapshot_id == xcom["snapshot_id"]
    rows = hook.read_committed(manifest.to_dict())
    assert sorted(rows.column("ticket_id").to_pylist()) == list(range(300))
    assert set(rows.column("batchinfer_model_version").to_pylist()) == {"v1"}
    expected = {r["ticket_id"]: len(r["text"]) for r in pq.read_table(world["inputs"]).to_pylist()}
    assert dict(zip(rows.column("ticket_id").to_pylist(), rows.column("length").to_pylist(), strict=True)) == expected

    # an independent reader: plain pyiceberg in a fresh process, counted by DuckDB
    seen = read_in_fresh_process(props, TABLE, "run1", xcom["snapshot_id"])
    assert seen["rows"] == 300 and seen["ids"] == list(range(300)) and seen["sum_length"] == sum(expected.values())

    # lineage: the table by its location (naming spec), the catalog's name for it as a symlink
    lineage = op.get_openlineage_facets_on_complete(ti("run1"))
    out = lineage.outputs[0]
    assert (out.namespace, out.name) == ("file", table.location().removeprefix("file://"))
    assert [(i.name, i.type) for i in out.facets["symlinks"].identifiers] == [(TABLE, "TABLE")]
    assert out.outputFacets["outputStatistics"].rowCount == 300

    # SaveMode.ERROR with the same run key: refused before anything is written
    attempts = set(os.listdir(Path(table.location().removeprefix("file://")) / "data" / "batchinfer_run_key=run1"))
    with pytest.raises(AirflowFailException, match=r"already holds 300 row\(s\) of run key run1 .* SaveMode.ERROR"):
        operator(TABLE, world["inputs"]).execute({"ti": ti("run1", try_number=2)})
    table = catalog.load_table(TABLE)
    assert len(table.metadata.snapshots) == 1
    assert (
        set(os.listdir(Path(table.location().removeprefix("file://")) / "data" / "batchinfer_run_key=run1")) == attempts
    )


def _file_digests(table, run_key: str) -> dict[str, str]:
    return {
        path: hashlib.sha256(Path(path.removeprefix("file://")).read_bytes()).hexdigest()
        for path, key in data_files(table).items()
        if key == run_key
    }


@slow
def test_overwrite_replaces_exactly_one_run_key(world):
    operator(TABLE, world["inputs"]).execute({"ti": ti("run2")})
    _, catalog = _catalog(world)
    table = catalog.load_table(TABLE)
    run2_files, run2_rows = _file_digests(table, "run2"), _rows(table, "run2")
    assert run2_files and run2_rows.num_rows == 300
    before = len(table.metadata.snapshots)

    xcom = operator(TABLE, world["inputs"], mode=SaveMode.OVERWRITE).execute({"ti": ti("run1", try_number=3)})
    table = catalog.load_table(TABLE)
    snapshot = table.current_snapshot()
    assert len(table.metadata.snapshots) == before + 1 and snapshot.snapshot_id == xcom["snapshot_id"]
    assert snapshot.summary["operation"].value == "overwrite"
    assert (snapshot.summary["deleted-records"], snapshot.summary["added-records"]) == ("300", "300")
    assert _file_digests(table, "run2") == run2_files  # the other run key: the very same files, same bytes
    assert _rows(table, "run2").equals(run2_rows)
    run1 = {Path(p).parent.name for p, k in data_files(table).items() if k == "run1"}
    assert run1 == {xcom["attempt"]}  # run1 is exactly the new attempt's rows
    assert table.scan().to_arrow().num_rows == 600


def _rows(table, run_key: str):
    from pyiceberg.expressions import EqualTo

    return table.scan(row_filter=EqualTo("batchinfer_run_key", run_key)).to_arrow().sort_by("ticket_id")


def _complete_parts(directory: Path) -> list[Path]:
    done = []
    for part in sorted(directory.glob("*/part-*.parquet")) if directory.exists() else []:
        try:
            pq.read_metadata(part)
            done.append(part)
        except Exception:
            pass
    return done


@slow
def test_a_run_killed_mid_write_leaves_the_table_as_it_was(world):
    _, catalog = _catalog(world)
    table = catalog.load_table(TABLE)
    current = table.current_snapshot().snapshot_id
    run_dir = Path(table.location().removeprefix("file://")) / "data" / "batchinfer_run_key=run3"
    op = operator(TABLE, world["inputs"], model="slow_length", max_batch_rows=20, rows_per_part=20)
    failure: list[BaseException] = []

    def run():
        try:
            op.execute({"ti": ti("run3")})
        except BaseException as exc:  # the killed job fails the try
            failure.append(exc)

    task = threading.Thread(target=run)
    task.start()
    deadline = time.monotonic() + 180
    while len(_complete_parts(run_dir)) < 2 and time.monotonic() < deadline and task.is_alive():
        time.sleep(0.1)
    proc = op._launcher._proc if op._launcher is not None else None
    assert proc is not None, f"the run ended before it could be killed: {failure}"
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9: the job gets no chance to clean up
    task.join(timeout=60)
    assert failure, "the killed run did not fail its task"
    time.sleep(2)  # the killed driver's workers are gone: nothing changes the table after this
    table = catalog.load_table(TABLE)
    assert table.current_snapshot().snapshot_id == current
    assert all(key != "run3" for key in data_files(table).values())
    written = _complete_parts(run_dir)
    assert written, "the kill came before any data file was written"
    referenced = set(data_files(table))
    assert not any(f"file://{p}" in referenced or str(p) in referenced for p in written)


def _raw_tickets(catalog, day: str, ids: range) -> int:
    """Append tickets of ``day`` to the input table ``raw.tickets`` (created on first use); the new snapshot."""
    import pyarrow as pa
    from pyiceberg.exceptions import NamespaceAlreadyExistsError

    rows = pa.table(
        {
            "ticket_id": pa.array(list(ids), pa.int64()),
            "text": [f"ticket {i} " + "x" * (i % 11) for i in ids],
            "day": [day] * len(ids),
        }
    )
    try:
        catalog.create_namespace("raw")
    except NamespaceAlreadyExistsError:
        pass
    table = catalog.create_table_if_not_exists("raw.tickets", schema=rows.schema)
    table.append(rows)
    return table.current_snapshot().snapshot_id


def _no_rows_read_here(monkeypatch):
    """pyiceberg's row reads refused in this process (the Airflow worker's, which runs ``execute``):
    a table input's rows must be read by the job, never here."""
    from pyiceberg.io.pyarrow import ArrowScan

    def refuse(*_, **__):
        raise AssertionError("the Airflow worker read rows of an Iceberg table")

    monkeypatch.setattr(ArrowScan, "to_record_batches", refuse)
    monkeypatch.setattr(ArrowScan, "to_table", refuse)


def _input_lines(logged: str, snapshot: int) -> tuple[list[str], list[str]]:
    """(the job's lines, forwarded into the task log, saying it read ``raw.tickets`` at
    ``snapshot``; the task's own lines saying it materialized a table input, with a row count)."""
    read = f"[batchinfer] input: 100 rows of Iceberg table raw.tickets at snapshot {snapshot} where day = 'd1' read in"
    by_job = [line for line in logged.splitlines() if read in line]
    by_task = [line for line in logged.splitlines() if re.search(r"\bInput: [\d,]+ rows of Iceberg table", line)]
    return by_job, by_task


@slow
def test_concurrent_runs_land_and_a_table_input_is_read_by_the_job_at_its_pinned_snapshot(world, monkeypatch, capsys):
    _, catalog = _catalog(world)
    _raw_tickets(catalog, "d1", range(1000, 1100))
    pinned = _raw_tickets(catalog, "d2", range(2000, 2050))
    source = iceberg_input("raw.tickets", row_filter="day = 'd1'")
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def run(run_id, inputs):
        try:
            results[run_id] = operator(TABLE, inputs, task_id=f"infer_{run_id}").execute({"ti": ti(run_id)})
        except BaseException as exc:
            errors.append(exc)

    capsys.readouterr()
    with monkeypatch.context() as here:
        _no_rows_read_here(here)
        threads = [threading.Thread(target=run, args=a) for a in (("run4", world["inputs"]), ("run5", source))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    by_job, by_task = _input_lines(capsys.readouterr().out, pinned)  # the task log, the job's lines in it
    assert len(by_job) == 1 and " 1 task(s) in the driver process (" in by_job[0] and not by_task, (by_job, by_task)
    table = catalog.load_table(TABLE)
    assert {k: _rows(table, k).num_rows for k in ("run4", "run5")} == {"run4": 300, "run5": 100}
    first = table.snapshot_by_id(results["run5"]["snapshot_id"])
    assert first.summary["batchinfer.input.snapshot-id"] == str(pinned)
    assert sorted(_rows(table, "run5").column("ticket_id").to_pylist()) == list(range(1000, 1100))

    # the input table moves on; a retry of run5 reads the snapshot its first try pinned
    _raw_tickets(catalog, "d1", range(1100, 1120))
    capsys.readouterr()
    with monkeypatch.context() as here:
        _no_rows_read_here(here)
        xcom = operator(TABLE, source, mode=SaveMode.OVERWRITE, task_id="infer_run5").execute({"ti": ti("run5", 2)})
    assert xcom["rows"] == 100 and xcom["input_rows"] == 100
    by_job, by_task = _input_lines(capsys.readouterr().out, pinned)
    assert len(by_job) == 1 and not by_task, (by_job, by_task)
    table = catalog.load_table(TABLE)
    assert table.snapshot_by_id(xcom["snapshot_id"]).summary["batchinfer.input.snapshot-id"] == str(pinned)
    assert sorted(_rows(table, "run5").column("ticket_id").to_pylist()) == list(range(1000, 1100))
    assert _rows(table, "run4").num_rows == 300


def test_on_a_cluster_ray_tasks_read_the_pinned_snapshot_one_task_per_data_file(
    world, ray_cluster, monkeypatch, capsys
):
    """The read a job on the actor pool does first: each data file of the pinned, filtered snapshot
    is read by a Ray task on the cluster (which rebuilds the table's FileIO without the driver's),
    into the claim's ``_input/<attempt>/``; this process reads no rows."""
    import dataclasses

    import pyarrow as pa

    from airflow_provider_batchinfer.runtime.inputs import table_input

    props, catalog = _catalog(world)
    _raw_tickets(catalog, "d9", range(5000, 5030))
    pinned = _raw_tickets(catalog, "d9", range(5030, 5050))  # a second data file of day d9
    _raw_tickets(catalog, "d9", range(5050, 5060))  # after the pin: not read
    claim = world["root"] / "claims" / "run9"
    job = dataclasses.replace(
        job_file(claim, inputs=(str(claim / "_input"),)),
        table_input=TableInput("raw.tickets", public_catalog(props), pinned, "day = 'd9'"),
    )
    monkeypatch.setattr(table_input, "MIN_GROUP_ROWS", 1)  # one task per data file
    # the session cluster takes the token; an earlier in-process run of this worker may have left
    # RAY_AUTH_MODE at another value in this process
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    _no_rows_read_here(monkeypatch)
    try:
        locations = table_input.read_table_input(job, None)
    finally:
        table_input.leave_ray()
    assert locations == [str(claim / "_input" / job.attempt)]
    files = sorted(Path(locations[0]).iterdir())
    assert [f.name for f in files] == ["part-00000-000.parquet", "part-00001-000.parquet"]
    rows = pa.concat_tables([pq.read_table(f) for f in files])
    assert rows.column_names == ["ticket_id", "text", "day"] and rows.schema.field("text").type == pa.string()
    assert sorted(rows.column("ticket_id").to_pylist()) == list(range(5000, 5050))
    line = f"[batchinfer] input: 50 rows of Iceberg table raw.tickets at snapshot {pinned} where day = 'd9' read in 2"
    assert f"{line} task(s) on Ray (2 data file(s)" in capsys.readouterr().out


@slow
def test_the_example_dag_writes_a_table_and_publishes_it_with_duckdb(world):
    from tests.conftest import run_dag, xcom_value

    state, tasks, run_id = run_dag("batchinfer_iceberg_scores", num_customers=2000)
    assert state == "success", tasks
    published = xcom_value("batchinfer_iceberg_scores", run_id, "publish")
    _, catalog = _catalog(world)
    table = catalog.load_table("ml.churn_scores")
    assert published["table"] == "ml.churn_scores" and published["rows"] == 2000
    assert published["snapshot_id"] == table.current_snapshot().snapshot_id
    assert 0 < published["at_risk"] < 2000
