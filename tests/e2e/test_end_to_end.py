"""End to end on real parts: Airflow's dag.test() on SQLite, a real Ray cluster, real models."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, JobFile, ModelRef, RunOwner
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec
from tests.conftest import run_dag
from tests.models import committed_manifest, write_tickets

pytestmark = pytest.mark.usefixtures("airflow_db")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _job_file(run_dir: Path, dag_id: str, task_id: str, attempt: str = "t01old") -> str:
    """The ``_job.json`` an earlier job of ``dag_id.task_id`` left in ``run_dir``."""
    return JobFile(
        job_id=f"batchinfer-{dag_id}-{task_id}-{attempt}",
        attempt=attempt,
        launcher="local",
        run_dir=str(run_dir),
        input_locations=("/elsewhere",),
        input_spec=InputSpec(),
        job_spec=JobSpec(),
        model=ModelRef("text_length", "v1", "python", "0" * 64, "/registry/text_length/v1"),
        registry_root="/registry",
        airflow=RunOwner(dag_id=dag_id, task_id=task_id, run_id="manual__old", try_number=1),
    ).to_json()


def _part_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("part-*.parquet"))


def test_error_mode_refuses_a_non_empty_directory_before_launching(
    batchinfer_home, text_length_model, tickets, tmp_path
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.parquet").write_bytes(b"keep me")
    before = _snapshot(out)
    state, tasks, _ = run_dag("bi_test_error_mode", input=str(tickets[0]), out=str(out))
    assert state == "failed" and tasks["infer"][0] == "failed"
    assert _snapshot(out) == before  # untouched: no _job.json, no parts, no marker


def test_retry_with_overwrite_after_an_injected_failure_leaves_one_clean_result(
    batchinfer_home, text_length_model, tmp_path
):
    flag = tmp_path / "fail-once"
    flag.write_text("x")
    tickets = write_tickets(tmp_path / "input", rows=500, files=4, fail_once_flag=flag)
    out = tmp_path / "out"
    state, tasks, _ = run_dag("bi_test_overwrite_retry", input=str(tickets), out=str(out))
    assert state == "success", tasks
    assert tasks["infer"] == ("success", 2) and not flag.exists()
    manifest = json.loads((out / SUCCESS_MARKER).read_text())
    assert manifest["job"]["attempt"].startswith("t02")
    assert _part_files(out) == sorted(f["name"] for f in manifest["files"])
    assert all(attempt_of(name) == manifest["job"]["attempt"] for name in _part_files(out))
    assert manifest["counts"] == {"input_rows": 500, "output_rows": 500, "error_rows": 0}
    rows = pq.read_table([str(out / n) for n in _part_files(out)])
    assert sorted(rows.column("ticket_id").to_pylist()) == list(range(500))


def test_error_mode_retry_cleans_only_its_own_uncommitted_try(batchinfer_home, text_length_model, tmp_path):
    """ERROR protects committed and foreign data; the leftovers of a failed try of the same task
    and run are its own, so the scheduler's retry may replace them."""
    flag = tmp_path / "fail-once"
    flag.write_text("x")
    tickets = write_tickets(tmp_path / "input", rows=300, files=3, fail_once_flag=flag)
    out = tmp_path / "out"
    state, tasks, _ = run_dag("bi_test_error_mode_retry", input=str(tickets), out=str(out))
    assert state == "success", tasks
    assert tasks["infer"] == ("success", 2)
    manifest = committed_manifest(str(out))
    assert manifest["counts"]["output_rows"] == 300
    assert _part_files(out) == sorted(f["name"] for f in manifest["files"])
    # a second run (another run_id) against the committed directory is refused and changes nothing
    before = _snapshot(out)
    state, _, _ = run_dag("bi_test_error_mode_retry", input=str(tickets), out=str(out))
    assert state == "failed" and _snapshot(out) == before


def attempt_of(part_name: str) -> str:
    return part_name.rsplit("-", 1)[1].removesuffix(".parquet")


def test_overwrite_removes_a_stale_marker_and_stray_parts(batchinfer_home, text_length_model, tickets, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / JOB_SPEC_FILE).write_text(_job_file(out, "bi_test_overwrite_retry", "infer"))
    (out / "part-00007-t01old.parquet").write_bytes(b"stale")
    (out / SUCCESS_MARKER).write_text("{}")
    state, tasks, _ = run_dag("bi_test_overwrite_retry", input=str(tickets[0]), out=str(out))
    assert state == "success", tasks
    assert "part-00007-t01old.parquet" not in _part_files(out)
    assert committed_manifest(str(out))["counts"]["output_rows"] == 500


@pytest.mark.parametrize(
    ("job_file", "expected"),
    [
        (None, "no batchinfer task wrote"),
        (("other_dag", "other_task"), "belongs to other_dag.other_task"),
    ],
)
def test_overwrite_refuses_directories_it_does_not_own(
    batchinfer_home, text_length_model, tickets, tmp_path, capfd, job_file, expected
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.parquet").write_bytes(b"someone else's")
    if job_file:
        (out / JOB_SPEC_FILE).write_text(_job_file(out, *job_file))
    before = _snapshot(out)
    state, _tasks, _ = run_dag("bi_test_overwrite_retry", input=str(tickets[0]), out=str(out))
    assert state == "failed"
    assert _snapshot(out) == before
    assert expected in capfd.readouterr().out


def test_sql_input_is_materialized_in_chunks(batchinfer_home, text_length_model, tmp_path, monkeypatch):
    db = tmp_path / "tickets.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE tickets (id INTEGER PRIMARY KEY, body TEXT)")
        conn.executemany("INSERT INTO tickets VALUES (?, ?)", [(i, f"ticket number {i}") for i in range(1000)])
    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_SQLITE", json.dumps({"conn_type": "sqlite", "host": str(db)}))
    out = tmp_path / "out"
    state, tasks, _ = run_dag("bi_test_sql_input", out=str(out))
    assert state == "success", tasks
    assert len(list((out / "_input").glob("*/part-*.parquet"))) == 10  # written by the job, one per chunk
    manifest = committed_manifest(str(out))
    assert manifest["counts"]["output_rows"] == 1000
    table = pq.read_table([str(out / f["name"]) for f in manifest["files"]]).sort_by("ticket_id")
    assert table.column("length").to_pylist()[:3] == [
        len("ticket number 0"),
        len("ticket number 1"),
        len("ticket number 2"),
    ]


def test_without_an_address_the_job_starts_its_own_ray_beside_a_running_cluster(
    batchinfer_home, text_length_model, tickets, tmp_path, monkeypatch, ray_cluster, capfd
):
    """The embedded default must not attach to another `ray start` cluster on the machine (here the
    session's, which uses token auth): ray.init(address=None) would, and hang there."""
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("BATCHINFER_IN_DRIVER_MAX_ROWS", "0")  # 500 rows, but the driver must attach to a Ray
    monkeypatch.delenv("RAY_AUTH_MODE")
    out = tmp_path / "out"
    state, tasks, _ = run_dag("bi_test_error_mode", input=str(tickets[0]), out=str(out))
    assert state == "success", tasks
    assert committed_manifest(str(out))["counts"]["output_rows"] == 500
    (launched,) = [line for line in capfd.readouterr().out.splitlines() if "Launching batch inference job" in line]
    assert "(embedded Ray at " in launched and ray_cluster["address"] not in launched


def test_the_version_probe_reads_the_running_clusters_ray_version(ray_cluster):
    """What the local launcher compares before it attaches: the version the cluster's GCS records."""
    import os

    import ray

    from airflow_provider_batchinfer.launchers.local import cluster_ray_version

    assert cluster_ray_version(ray_cluster["address"], dict(os.environ)) == ray.__version__
