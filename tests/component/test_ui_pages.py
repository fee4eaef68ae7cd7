"""The batch runs pages in Airflow's own api-server app, in-process (``create_app("core")``: the plugin
is loaded from its entry point and mounted as the api-server mounts it), on the session's SQLite
metadata DB. 2,000 runs are real rows (DAG runs, task instances, XCom return values) inserted in
bulk; one of them points at a real committed run directory with dead-lettered rows."""

from __future__ import annotations

import hashlib
import io
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from tests.runs import manifest_for, write_part

DAG_ID = "bi_ui_bulk"
OTHER_DAG = "bi_ui_other"
RUNS = 2000


def _error_part(run_dir, name: str, ids: list[int]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.contract import FileEntry

    sink = io.BytesIO()
    messages = [f"cannot score text 'boom' (row {i})" for i in ids]
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "error": messages}), sink)
    data = sink.getvalue()
    (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / name).write_bytes(data)
    return FileEntry(name=name, size=len(data), rows=len(ids), sha256=hashlib.sha256(data).hexdigest())


def _result(i: int, location: str, attempt: str = "t01aaaa") -> dict:
    """What the operator pushes as its return value (operators/finalize.py), for run ``i``."""
    cost = None if i % 3 else 0.001 * (i + 1)
    return {
        "output_location": location,
        "manifest_location": f"{location}/_SUCCESS",
        "rows": 100 + i,
        "input_rows": 102 + i,
        "error_rows": 2,
        "files": ["part-00000.parquet"],
        "error_files": [],
        "model": "text_length" if i % 2 else "other_model",
        "model_version": "v1",
        "sha256": hashlib.sha256(str(i).encode()).hexdigest(),
        "job_id": f"job-{i}",
        "attempt": attempt,
        "usage": {
            "wall_s": 10.0 + i % 7,
            "held_s": 9.0,
            "reserved_cpus": 2.0,
            "reserved_gpus": 0.0,
            "cpu_seconds": 18.0,
            "gpu_seconds": 0.0,
            "rows": 102 + i,
            "rows_per_s": (102 + i) / (10.0 + i % 7),
            "cost": cost,
        },
        "reused_rows": 0,
    }


def _seed(session, dag_id: str, count: int, first_location: str | None) -> None:
    """``count`` DAG runs of ``dag_id``, each with one task instance of the operator and its XCom."""
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from sqlalchemy import insert, select

    session.merge(DagBundleModel(name="ui_tests"))
    session.flush()
    session.add(DagModel(dag_id=dag_id, fileloc=f"/dags/{dag_id}.py", bundle_name="ui_tests", is_stale=False))
    session.flush()
    t0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
    session.execute(
        insert(DagRun.__table__),
        [
            {
                "dag_id": dag_id,
                "run_id": f"manual__{i:05d}",
                "run_type": "manual",
                "state": "success",
                "run_after": t0 + timedelta(minutes=i),
                "clear_number": 0,
                "log_template_id": None,
            }
            for i in range(count)
        ],
    )
    ids = dict(session.execute(select(DagRun.run_id, DagRun.id).where(DagRun.dag_id == dag_id)).all())
    session.execute(
        insert(TaskInstance.__table__),
        [
            {
                "id": uuid.uuid4(),
                "dag_id": dag_id,
                "task_id": "infer",
                "run_id": f"manual__{i:05d}",
                "map_index": -1,
                "try_number": 1,
                "state": "success",
                "operator": "BatchInferenceOperator",
                "pool": "default_pool",
                "pool_slots": 1,
                "priority_weight": 1,
                "max_tries": 0,
                "hostname": "",
                "unixname": "test",
                "queue": "default",
                "start_date": t0 + timedelta(minutes=i),
                "end_date": t0 + timedelta(minutes=i, seconds=12),
                "duration": 12.0,
            }
            for i in range(count)
        ],
    )
    session.execute(
        insert(XComModel.__table__),
        [
            {
                "dag_run_id": ids[f"manual__{i:05d}"],
                "task_id": "infer",
                "map_index": -1,
                "key": "return_value",
                "dag_id": dag_id,
                "run_id": f"manual__{i:05d}",
                "value": _result(i, first_location if i == count - 1 and first_location else f"/gone/{dag_id}/{i}"),
                "timestamp": t0 + timedelta(minutes=i),
            }
            for i in range(count)
        ],
    )
    session.commit()


@pytest.fixture(scope="module")
def api(airflow_db, tmp_path_factory):
    """The api-server's app with the plugin mounted, 2,000 runs of one DAG and one run of another, and
    a bearer token for the admin and for a user the test auth manager keeps out of ``OTHER_DAG``."""
    from airflow.api_fastapi.app import create_app, get_auth_manager, purge_cached_app
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from airflow.utils.session import create_session
    from fastapi.testclient import TestClient

    from airflow_provider_batchinfer.contract import SUCCESS_MARKER, part_name

    run_dir = tmp_path_factory.mktemp("ui") / "run"
    run_dir.mkdir()
    part = write_part(run_dir, part_name(0, "t01aaaa"), list(range(8)))
    errors = _error_part(run_dir, part_name(0, "t01aaaa", dead_letter=True), [8, 9])
    manifest = manifest_for(run_dir, (part,), (errors,))
    (run_dir / SUCCESS_MARKER).write_text(manifest.to_json())
    t0 = time.perf_counter()
    with create_session() as session:
        _seed(session, DAG_ID, RUNS, str(run_dir))
        _seed(session, OTHER_DAG, 1, None)
    t1 = time.perf_counter()
    purge_cached_app()
    app = create_app("core")
    print(
        f"\n{RUNS + 1} runs inserted in {t1 - t0:.1f} s; the api-server app built in {time.perf_counter() - t1:.1f} s"
    )
    manager = get_auth_manager()
    admin = manager.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    with TestClient(app) as client:
        yield {"client": client, "admin": {"Authorization": f"Bearer {admin}"}, "manifest": manifest}


def test_the_plugin_is_mounted_with_its_nav_entry(api):
    client = api["client"]
    plugins = client.get("/api/v2/plugins", headers=api["admin"]).json()["plugins"]
    ours = next(p for p in plugins if p["name"] == "batchinfer")
    assert ours["external_views"][0]["href"] == "batchinfer/runs"
    assert ours["fastapi_apps"][0]["url_prefix"] == "/batchinfer"


def test_without_a_token_every_endpoint_answers_401(api):
    client = api["client"]
    for path in ("/batchinfer/api/runs", f"/batchinfer/api/trends?dag_id={DAG_ID}&task_id=infer", "/batchinfer/runs"):
        response = client.get(path)
        assert response.status_code == 401, (path, response.text)
    page = client.get("/batchinfer/runs")
    assert "Not signed in" in page.text and "Traceback" not in page.text


def test_the_list_is_paginated_filtered_and_fast_with_2000_runs(api):
    client, headers = api["client"], api["admin"]
    t0 = time.perf_counter()
    page = client.get("/batchinfer/runs", headers=headers)
    elapsed = time.perf_counter() - t0
    print(f"\nbatch runs page with {RUNS + 1} runs in the DB: {elapsed * 1000:.0f} ms, {len(page.content):,} bytes")
    assert page.status_code == 200, page.text
    assert f"of {RUNS + 1:,}" in page.text and 'href="static/batchinfer.css"' in page.text
    assert page.text.count("<tr>") == 51  # a header row and 50 runs: never all 2,001 in one response
    # no script to run, and only relative links (the UI may sit under a path prefix)
    assert "<script" not in page.text and 'href="/' not in page.text and 'src="/' not in page.text
    data = client.get("/batchinfer/api/runs", params={"dag_id": DAG_ID, "limit": 10, "offset": 5}, headers=headers)
    body = data.json()
    assert body["total"] == RUNS and [r["run_id"] for r in body["runs"]][:2] == ["manual__01994", "manual__01993"]
    first = body["runs"][0]
    expected = _result(1994, "")
    assert (first["input_rows"], first["output_rows"], first["error_rows"]) == (2096, 2094, 2)
    assert first["rows_per_s"] == pytest.approx(expected["usage"]["rows_per_s"]) and first["cost"] is None
    models = client.get("/batchinfer/api/runs", params={"model": "text_length", "limit": 1}, headers=headers).json()
    assert models["total"] == RUNS // 2
    failed = client.get("/batchinfer/api/runs", params={"state": "failed"}, headers=headers).json()
    assert failed["total"] == 0 and failed["runs"] == []


def test_the_run_page_shows_the_manifest_and_the_first_dead_lettered_rows(api):
    client, headers = api["client"], api["admin"]
    params = {"dag_id": DAG_ID, "task_id": "infer", "run_id": f"manual__{RUNS - 1:05d}"}
    body = client.get("/batchinfer/api/run", params=params, headers=headers).json()
    manifest = api["manifest"]
    assert body["problem"] is None, body
    assert body["manifest"]["counts"] == manifest.counts.to_dict()
    assert [f["sha256"] for f in body["manifest"]["files"]] == [f.sha256 for f in manifest.files]
    assert [e["error"] for e in body["errors"]] == [
        "cannot score text 'boom' (row 8)",
        "cannot score text 'boom' (row 9)",
    ]
    assert [e["id"] for e in body["errors"]] == ["8", "9"]
    page = client.get("/batchinfer/run", params=params, headers=headers)
    assert page.status_code == 200 and "cannot score text" in page.text and manifest.files[0].sha256 in page.text
    assert 'href="../dags/bi_ui_bulk/runs/manual__01999/tasks/infer"' in page.text
    assert "<script" not in page.text and 'href="/' not in page.text


def test_a_gone_manifest_is_a_message_not_a_stack_trace(api):
    client, headers = api["client"], api["admin"]
    params = {"dag_id": DAG_ID, "task_id": "infer", "run_id": "manual__00003"}
    body = client.get("/batchinfer/api/run", params=params, headers=headers).json()
    assert body["problem"] == f"the manifest at /gone/{DAG_ID}/3 is gone: the run's output was removed or replaced"
    page = client.get("/batchinfer/run", params=params, headers=headers)
    assert page.status_code == 200 and "is gone" in page.text and "Traceback" not in page.text
    missing = client.get("/batchinfer/run", params={**params, "run_id": "nope"}, headers=headers)
    assert missing.status_code == 404 and "no batch inference run bi_ui_bulk.infer nope" in missing.text


def test_the_trends_page_plots_three_series_as_inline_svg(api):
    client, headers = api["client"], api["admin"]
    params = {"dag_id": DAG_ID, "task_id": "infer"}
    body = client.get("/batchinfer/api/trends", params=params, headers=headers).json()
    assert len(body["points"]) == 200 and body["points"][-1]["run_id"] == f"manual__{RUNS - 1:05d}"
    page = client.get("/batchinfer/trends", params=params, headers=headers)
    assert page.status_code == 200 and page.text.count("<svg") == 3 and "<script" not in page.text
