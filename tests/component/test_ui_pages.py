"""The batch runs pages in-process: the plugin's app (as its entry point gives it) mounted under its
prefix, behind Airflow's own auth manager, on the session's SQLite metadata DB (the real
api-server's mount and nav entry are checked in the services tier). 2,000 runs are real rows (DAG runs, task instances, XCom return values) inserted in
bulk; one of them points at a real committed run directory with dead-lettered rows."""

from __future__ import annotations

import hashlib
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.ui_seed import committed_run_with_dead_letters, seed_runs

DAG_ID = "bi_ui_bulk"
OTHER_DAG = "bi_ui_other"
RUNS = 2000
START = datetime(2026, 11, 1, tzinfo=timezone.utc)


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


@pytest.fixture(scope="module")
def api(airflow_db):
    """The plugin's app under its prefix with Airflow's auth manager, 2,000 runs of one DAG and one run
    of another, and a bearer token for the admin."""
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from airflow.utils.session import create_session
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from airflow_provider_batchinfer.hooks.service_config import ServiceConfig
    from airflow_provider_batchinfer.ui.plugin import URL_PREFIX, BatchInferencePlugin

    # the runs use the embedded default (no batchinfer_default connection): the page reads below its stage
    stage = Path(ServiceConfig.embedded().stage_root)
    run_dir = stage / "ui_pages" / "run"
    manifest = committed_run_with_dead_letters(run_dir)
    t0 = time.perf_counter()
    # the newest run names the real run directory; the others name directories that are gone
    results = [_result(i, f"{stage}/gone/{DAG_ID}/{i}") for i in range(RUNS - 1)] + [_result(RUNS - 1, str(run_dir))]
    with create_session() as session:
        run_ids = seed_runs(session, DAG_ID, "infer", results, START)
        seed_runs(session, OTHER_DAG, "infer", [_result(0, f"{stage}/gone/other")], START)
    t1 = time.perf_counter()
    app = FastAPI()
    manager = init_auth_manager(app)
    (plugin_app,) = BatchInferencePlugin().fastapi_apps
    assert plugin_app["url_prefix"] == URL_PREFIX
    app.mount(URL_PREFIX, plugin_app["app"])
    print(f"\n{RUNS + 1} runs inserted in {t1 - t0:.1f} s; the plugin's app built in {time.perf_counter() - t1:.1f} s")
    admin = manager.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    with TestClient(app) as client:
        yield {
            "client": client,
            "admin": {"Authorization": f"Bearer {admin}"},
            "manifest": manifest,
            "runs": run_ids,
            "stage": stage,
        }


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
    assert body["total"] == RUNS and [r["run_id"] for r in body["runs"]][:2] == api["runs"][-6:-8:-1]
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
    params = {"dag_id": DAG_ID, "task_id": "infer", "run_id": api["runs"][-1]}
    body = client.get("/batchinfer/api/run", params=params, headers=headers).json()
    manifest = api["manifest"]
    assert body["problem"] is None, body
    assert body["manifest"]["counts"] == manifest.counts.to_dict()
    assert [f["sha256"] for f in body["manifest"]["files"]] == [f.sha256 for f in manifest.files]
    assert [e["error"] for e in body["errors"]] == [
        "ValueError: cannot score text 'boom' (row 8)",
        "ValueError: cannot score text 'boom' (row 9)",
    ]
    assert [e["id"] for e in body["errors"]] == ["8", "9"]
    page = client.get("/batchinfer/run", params=params, headers=headers)
    assert page.status_code == 200 and "cannot score text" in page.text and manifest.files[0].sha256 in page.text
    assert f'href="../dags/bi_ui_bulk/runs/{quote(api["runs"][-1], safe="")}/tasks/infer"' in page.text
    assert "<script" not in page.text and 'href="/' not in page.text


def test_a_gone_manifest_is_a_message_not_a_stack_trace(api):
    client, headers = api["client"], api["admin"]
    params = {"dag_id": DAG_ID, "task_id": "infer", "run_id": api["runs"][3]}
    body = client.get("/batchinfer/api/run", params=params, headers=headers).json()
    gone = f"{api['stage']}/gone/{DAG_ID}/3"
    assert body["problem"] == f"the manifest at {gone} is gone: the run's output was removed or replaced"
    page = client.get("/batchinfer/run", params=params, headers=headers)
    assert page.status_code == 200 and "is gone" in page.text and "Traceback" not in page.text
    missing = client.get("/batchinfer/run", params={**params, "run_id": "nope"}, headers=headers)
    assert missing.status_code == 404 and "no batch inference run bi_ui_bulk.infer nope" in missing.text


def test_the_trends_page_plots_three_series_as_inline_svg(api):
    client, headers = api["client"], api["admin"]
    params = {"dag_id": DAG_ID, "task_id": "infer"}
    body = client.get("/batchinfer/api/trends", params=params, headers=headers).json()
    assert len(body["points"]) == 200 and body["points"][-1]["run_id"] == api["runs"][-1]
    page = client.get("/batchinfer/trends", params=params, headers=headers)
    assert page.status_code == 200 and page.text.count("<svg") == 3 and "<script" not in page.text
