"""The table commit on its own (``runtime/table_commit.commit_table``), without Ray: attempts whose
data files are already written, committed into a real SQL catalog (SQLite) the way the driver does
after its pipeline. Covers what a pipeline cannot time on purpose: a zombie attempt, a run key
committed by someone else between the start and the commit, and commits racing each other."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import FileEntry, JobFile, Manifest
from airflow_provider_batchinfer.contract.tables import MODEL_VERSION_COLUMN, RUN_KEY_COLUMN, TableOutput
from airflow_provider_batchinfer.runtime.output.table_commit import TableCommitError, commit_table
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.commit.rundir import FencedError
from airflow_provider_batchinfer.store.iceberg.catalog import embedded_catalog, open_catalog
from airflow_provider_batchinfer.store.stage import Stage
from tests.iceberg_support import data_files
from tests.runs import job_file, manifest_for

TABLE = "ml.commits"


@pytest.fixture
def catalog_props(tmp_path):
    return embedded_catalog(str(tmp_path / "stage"), str(tmp_path))


def written_attempt(
    tmp_path: Path, props: dict, run_key: str, attempt: str, ids: range, mode: str = "error"
) -> tuple[JobFile, Stage, Manifest]:
    """What the pipeline leaves before the commit: the claim naming ``attempt`` and its data files."""
    claim_dir = tmp_path / "claims" / run_key
    claim_dir.mkdir(parents=True, exist_ok=True)
    location = f"{props['warehouse']}/ml.db/commits"
    data_dir = Stage.open(f"{location}/data/{RUN_KEY_COLUMN}={run_key}/{attempt}")
    data_dir.fs.create_dir(data_dir.path, recursive=True)
    entries = []
    for n, chunk in enumerate((ids[: len(ids) // 2], ids[len(ids) // 2 :])):
        table = pa.table(
            {
                "ticket_id": pa.array(list(chunk), pa.int64()),
                "length": pa.array([i * 2 for i in chunk], pa.int64()),
                RUN_KEY_COLUMN: [run_key] * len(chunk),
                MODEL_VERSION_COLUMN: ["v1"] * len(chunk),
            }
        )
        name = f"part-{n:05d}-{attempt}.parquet"
        pq.write_table(table, f"{data_dir.path}/{name}")
        data = Path(f"{data_dir.path}/{name}").read_bytes()
        entries.append(FileEntry(name, len(data), len(chunk), hashlib.sha256(data).hexdigest()))
    target = TableOutput(TABLE, props, run_key, mode, str(claim_dir), location)
    job = dataclasses.replace(job_file(data_dir.location, attempt=attempt), table_output=target)
    rundir.claim(Stage.open(str(claim_dir)), job)
    return job, data_dir, manifest_for(data_dir.location, tuple(entries), attempt=attempt)


def test_a_zombie_attempt_cannot_commit_over_a_newer_one(tmp_path, catalog_props):
    job, data_dir, manifest = written_attempt(tmp_path, catalog_props, "day1", "t01first", range(100))
    committed = commit_table(job, data_dir, manifest)
    zombie, zombie_dir, zombie_manifest = written_attempt(tmp_path, catalog_props, "day2", "t01zombie", range(50))
    newer = dataclasses.replace(zombie, attempt="t02newer")
    rundir.claim(Stage.open(zombie.table_output.claim_dir), newer)  # a retry took the run over
    with pytest.raises(FencedError, match="attempt t01zombie is no longer the owner .* attempt t02newer"):
        commit_table(zombie, zombie_dir, zombie_manifest)
    table = open_catalog(catalog_props).load_table(TABLE)
    assert table.current_snapshot().snapshot_id == committed.table.snapshot_id
    assert set(data_files(table).values()) == {"day1"}  # nothing of the zombie is referenced


def test_error_mode_refuses_at_commit_when_the_run_key_landed_meanwhile(tmp_path, catalog_props):
    job, data_dir, manifest = written_attempt(tmp_path, catalog_props, "day1", "t01first", range(100))
    first = commit_table(job, data_dir, manifest)
    # another attempt of the same run key, started before the first committed (ERROR passed then)
    late, late_dir, late_manifest = written_attempt(tmp_path, catalog_props, "day1", "t02late", range(100))
    with pytest.raises(TableCommitError, match=r"already holds 100 row\(s\) of run key day1") as info:
        commit_table(late, late_dir, late_manifest)
    assert info.value.permanent
    table = open_catalog(catalog_props).load_table(TABLE)
    assert table.current_snapshot().snapshot_id == first.table.snapshot_id
    assert all("t02late" not in path for path in data_files(table))


def test_overwrite_replaces_one_run_key_in_one_snapshot(tmp_path, catalog_props):
    for key in ("day1", "day2"):
        job, data_dir, manifest = written_attempt(tmp_path, catalog_props, key, f"t01{key}", range(100))
        commit_table(job, data_dir, manifest)
    table = open_catalog(catalog_props).load_table(TABLE)
    before = {p: k for p, k in data_files(table).items() if k == "day2"}
    job, data_dir, manifest = written_attempt(tmp_path, catalog_props, "day1", "t02again", range(30), mode="overwrite")
    done = commit_table(job, data_dir, manifest)
    table = open_catalog(catalog_props).load_table(TABLE)
    snapshot = table.current_snapshot()
    assert snapshot.snapshot_id == done.table.snapshot_id and snapshot.summary["operation"].value == "overwrite"
    assert (snapshot.summary["deleted-records"], snapshot.summary["added-records"]) == ("100", "30")
    assert snapshot.parent_snapshot_id == table.metadata.snapshots[-2].snapshot_id  # one snapshot, no delete step
    files = data_files(table)
    assert {p: k for p, k in files.items() if k == "day2"} == before
    assert all("t02again" in p for p, k in files.items() if k == "day1")
    assert table.scan().to_arrow().num_rows == 130


def test_commits_of_different_run_keys_racing_each_other_all_land(tmp_path, catalog_props):
    attempts = [
        written_attempt(tmp_path, catalog_props, f"run{i}", f"t01r{i}", range(i * 10, i * 10 + 10)) for i in range(6)
    ]
    # the table exists before the race (creating it is a separate, idempotent step)
    commit_table(*attempts[0])
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def commit(attempt):
        start.wait()
        try:
            commit_table(*attempt)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=commit, args=(a,)) for a in attempts[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    table = open_catalog(catalog_props).load_table(TABLE)
    assert len(table.metadata.snapshots) == 6
    assert sorted(table.scan().to_arrow().column("ticket_id").to_pylist()) == list(range(60))
    assert sorted(s.summary["batchinfer.run-key"] for s in table.metadata.snapshots) == [f"run{i}" for i in range(6)]


def test_a_table_another_run_created_since_the_check_is_used_not_a_failure(tmp_path, catalog_props, monkeypatch):
    """Two first runs of a new table: both see no table, both create it, and the SQL catalog refuses
    the second create with a commit failure ("Table already exists"). The second run then uses the
    table the first created."""
    from airflow_provider_batchinfer.runtime.output import table_commit

    schema = pa.schema([("id", pa.int64()), (RUN_KEY_COLUMN, pa.string())])
    target = TableOutput(TABLE, {}, "r1", "error", str(tmp_path / "claims" / "r1"), "")
    catalog = open_catalog(catalog_props, {})
    first = table_commit.ensure_table(catalog, target, schema)
    real_load, calls = table_commit.load_table, []

    def load_table(c, name):  # the second run's check ran before the first run's create landed
        calls.append(name)
        return None if len(calls) == 1 else real_load(c, name)

    monkeypatch.setattr(table_commit, "load_table", load_table)
    second = table_commit.ensure_table(catalog, target, schema)
    assert second.metadata.table_uuid == first.metadata.table_uuid
