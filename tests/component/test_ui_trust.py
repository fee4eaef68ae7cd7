"""Attacks on the run page, through the plugin's app mounted as the api-server mounts it: a DAG's code
writes its XCom and its manifest, so neither may choose what the api-server reads.

Each attack points the page at dead-lettered rows holding ``SECRET`` that lie outside the
connection's roots (the embedded default's stage here), and checks the page shows a refusal, not
the rows, and built no storage handle (``Stage``) for anything outside the stage; the ``gs://``
attack also checks that its HTTP listener on 127.0.0.1 got no request at all (before the fix it got
the api-server's ambient token). A look-alike ``BatchInferenceOperator`` class from another module
is not listed, and its run page is a 404.

An Iceberg run is found through the connection's catalog, whose snapshot summaries anyone who can
commit to the catalog writes (``tests/forged_tables.py``): a summary naming a manifest outside the
roots, a ``gs://`` URI with an ``endpoint_override``, or a manifest in the stage naming a run
directory outside it is refused by the page, the sensor and its trigger (permanently, naming the
location and the roots) before anything there is opened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk import BaseOperator

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, FileEntry, part_name
from airflow_provider_batchinfer.store.stage import Stage
from tests.forged_tables import Listener, ambient_google_credentials, forge_snapshot, forged_run, gs_location, listening
from tests.runs import manifest_for, write_part
from tests.ui_seed import committed_run_with_dead_letters, seed_runs

SECRET = "SECRET-row-outside-the-stage"
START = datetime(2026, 11, 1, tzinfo=timezone.utc)
DAG_ID = "bi_ui_trust"
LOOKALIKE_DAG = "bi_ui_lookalike"
FORGED_TABLE = "ui_trust.forged"


class BatchInferenceOperator(BaseOperator):
    """Not the provider's operator: a class of the same name in a DAG author's module."""

    def execute(self, context: Any) -> None:
        return None


def _result(location: str) -> dict[str, Any]:
    return {"output_location": location, "rows": 8, "input_rows": 10, "error_rows": 2, "attempt": "t01aaaa"}


def _linked_run(run_dir: Path, outside: Path) -> None:
    """A run directory in the stage whose manifest is valid but whose dead-letter file is a symlink to
    the outside run's (same name, same size)."""
    part = write_part(run_dir, part_name(0, "t01aaaa"), list(range(8)))
    outside_manifest = json.loads((outside / SUCCESS_MARKER).read_text())
    entry = outside_manifest["error_files"][0]
    (run_dir / entry["name"]).parent.mkdir(parents=True)
    (run_dir / entry["name"]).symlink_to(outside / entry["name"])
    manifest = manifest_for(run_dir, (part,), (FileEntry.from_dict(entry, "entry"),))
    (run_dir / SUCCESS_MARKER).write_text(manifest.to_json())


@pytest.fixture(scope="module")
def trust(airflow_db, tmp_path_factory):
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from airflow.utils.session import create_session
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from airflow_provider_batchinfer.hooks.service_config import ServiceConfig
    from airflow_provider_batchinfer.ui.plugin import URL_PREFIX, BatchInferencePlugin

    stage = Path(ServiceConfig.embedded().stage_root)
    outside = tmp_path_factory.mktemp("outside") / "run"
    committed_run_with_dead_letters(outside, message=SECRET)  # a valid committed run, outside every root
    pointing = stage / "ui_trust" / "pointing"  # in the stage, its manifest names the outside run directory
    pointing.mkdir(parents=True)
    (pointing / SUCCESS_MARKER).write_text((outside / SUCCESS_MARKER).read_text())
    linked = stage / "ui_trust" / "linked"
    _linked_run(linked, outside)
    lookalike_run = stage / "ui_trust" / "lookalike"  # in the stage, listed only by the look-alike's XCom
    committed_run_with_dead_letters(lookalike_run, message=SECRET)

    listener = contextlib.ExitStack()  # the listener serves until the module's tests are done
    port = listener.enter_context(listening())
    # the api-server's ambient Google credentials: what a gs:// location would use without the connection
    adc = ambient_google_credentials(tmp_path_factory.mktemp("adc"), port)
    gs = gs_location(port, "run")
    tables = _forged_tables(stage, tmp_path_factory.mktemp("outside_table"), port)

    locations = {"outside": str(outside), "host": "/etc", "gs": gs, "pointing": str(pointing), "linked": str(linked)}
    locations.update({name: f"iceberg://{FORGED_TABLE}/{name}" for name in tables})
    with create_session() as session:
        runs = seed_runs(session, DAG_ID, "infer", [_result(v) for v in locations.values()], START)
        (lookalike,) = seed_runs(
            session,
            LOOKALIKE_DAG,
            "infer",
            [_result(str(lookalike_run))],
            START,
            make_task=lambda task_id: BatchInferenceOperator(task_id=task_id),
        )
    app = FastAPI()
    manager = init_auth_manager(app)
    (plugin_app,) = BatchInferencePlugin().fastapi_apps
    app.mount(URL_PREFIX, plugin_app["app"])
    admin = manager.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    built: list[str] = []
    original = Stage.__init__

    def spy(self: Stage, location: str, fs: Any, path: str) -> None:
        built.append(location)
        original(self, location, fs, path)

    with pytest.MonkeyPatch.context() as mp, TestClient(app) as client:
        mp.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
        mp.setattr(Stage, "__init__", spy)
        yield {
            "client": client,
            "headers": {"Authorization": f"Bearer {admin}"},
            "runs": dict(zip(locations, runs, strict=True)),
            "lookalike": lookalike,
            "outside": outside,
            "stage": stage,
            "lookalike_run": lookalike_run,
            "built": built,
            "requests": Listener.requests,
            "tables": tables,
        }
    listener.close()


def _forged_tables(stage: Path, outside: Path, port: int) -> dict[str, str]:
    """Snapshots of the embedded catalog's table ``ui_trust.forged``, by run key, each with the
    location its summary or manifest names outside the stage: a complete run outside the roots
    (its dead-lettered rows hold the secret), a gs:// URI sending the read to the listener, and a
    manifest in the stage whose run directory is that outside run."""
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    props = ModelServiceHook().catalog_properties()
    manifest_location, _ = forged_run(outside / "run", FORGED_TABLE, "table_outside", SECRET)
    forge_snapshot(props, FORGED_TABLE, "table_outside", manifest_location)
    gs = gs_location(port, "lake/_manifest.json")
    forge_snapshot(props, FORGED_TABLE, "table_gs", gs)
    _, pointing = forged_run(outside / "pointing", FORGED_TABLE, "table_pointing", SECRET)
    inside = stage / "ui_trust" / "table_pointing"
    shutil.copytree(outside / "pointing" / "claim", inside / "claim")
    data = pointing.to_dict()
    data["table"]["claim_dir"] = str(inside / "claim")  # the claim in the stage, the files outside it
    (inside / "_manifest.json").write_text(json.dumps(data))
    forge_snapshot(props, FORGED_TABLE, "table_pointing", str(inside / "_manifest.json"))
    return {"table_outside": manifest_location, "table_gs": gs, "table_pointing": pointing.run_dir}


def _run(trust: dict[str, Any], name: str) -> tuple[dict[str, Any], str]:
    """The run's JSON and page; neither shows the secret rows."""
    client, headers = trust["client"], trust["headers"]
    params = {"dag_id": DAG_ID, "task_id": "infer", "run_id": trust["runs"][name]}
    trust["built"].clear()
    body = client.get("/batchinfer/api/run", params=params, headers=headers).json()
    page = client.get("/batchinfer/run", params=params, headers=headers)
    assert page.status_code == 200 and "Traceback" not in page.text, page.text
    assert SECRET not in json.dumps(body) and SECRET not in page.text
    return body, page.text


def _opened_outside(trust: dict[str, Any]) -> list[str]:
    stage = str(trust["stage"])
    return [loc for loc in trust["built"] if loc != stage and not loc.startswith(stage + "/")]


@pytest.mark.parametrize("name", ["outside", "host"])
def test_a_forged_location_outside_the_roots_is_refused_unread(trust, name):
    body, page = _run(trust, name)
    assert body["problem"].startswith("the page does not read this run's output: ")
    assert f"is outside the connection's roots (stage_root {trust['stage']}, registry_root " in body["problem"], body
    assert body["manifest"] is None and body["errors"] == []
    assert "does not read this run" in page
    assert _opened_outside(trust) == [] and trust["built"] == []


def test_a_gs_uri_with_an_endpoint_override_sends_no_request(trust):
    trust["requests"].clear()
    body, page = _run(trust, "gs")
    assert trust["requests"] == [], "the api-server sent a request to the location's host"
    assert body["problem"].startswith("the page does not read this run's output: 'gs://bucket/run?endpoint_override")
    assert "holds a query" in body["problem"] and "does not read this run" in page
    assert trust["built"] == []


def test_a_manifest_naming_another_run_directory_is_refused(trust):
    body, page = _run(trust, "pointing")
    outside = str(trust["outside"])
    assert body["problem"].startswith(f"the manifest at {trust['stage']}/ui_trust/pointing is not valid")
    assert f"was written for the run directory {outside}" in body["problem"], body
    assert body["manifest"] is None and body["errors"] == [] and "is not valid" in page
    assert _opened_outside(trust) == []


def test_a_dead_letter_file_linked_out_of_the_stage_is_refused(trust):
    body, page = _run(trust, "linked")
    assert body["problem"] is None and body["manifest"]["run_dir"] == f"{trust['stage']}/ui_trust/linked"
    assert body["errors"] == []
    assert body["errors_problem"].startswith("the page does not read these dead-lettered rows: ")
    assert f"outside the connection's root {trust['stage']}" in body["errors_problem"]
    assert "does not read these dead-lettered rows" in page


def test_a_look_alike_operator_class_from_another_module_is_not_a_batch_run(trust):
    client, headers = trust["client"], trust["headers"]
    ours = client.get("/batchinfer/api/runs", params={"dag_id": DAG_ID}, headers=headers).json()
    assert ours["total"] == len(trust["runs"])
    theirs = client.get("/batchinfer/api/runs", params={"dag_id": LOOKALIKE_DAG}, headers=headers).json()
    assert (theirs["total"], theirs["runs"]) == (0, [])
    page = client.get("/batchinfer/runs", headers=headers)
    assert page.status_code == 200 and LOOKALIKE_DAG not in page.text  # nor among the filter's choices
    trust["built"].clear()
    params = {"dag_id": LOOKALIKE_DAG, "task_id": "infer", "run_id": trust["lookalike"]}
    page = client.get("/batchinfer/run", params=params, headers=headers)
    assert page.status_code == 404 and f"no batch inference run {LOOKALIKE_DAG}.infer" in page.text
    assert SECRET not in page.text
    trends = client.get("/batchinfer/api/trends", params={"dag_id": LOOKALIKE_DAG, "task_id": "infer"}, headers=headers)
    trends = trends.json()
    assert trends["points"] == []
    assert [loc for loc in trust["built"] if str(trust["lookalike_run"]) in loc] == []


def test_a_forged_table_summary_naming_a_manifest_outside_the_roots_is_refused_unread(trust):
    body, page = _run(trust, "table_outside")
    where = f"the page does not read this run's output: iceberg://{FORGED_TABLE}/table_outside (snapshot "
    assert body["problem"].startswith(where), body
    assert (
        f"the manifest its summary names is refused, and nothing of it is read: {trust['tables']['table_outside']} "
        f"is outside the connection's roots (stage_root {trust['stage']}, registry_root "
    ) in body["problem"]
    assert body["manifest"] is None and body["errors"] == [] and "does not read this run" in page
    assert _opened_outside(trust) == []


def test_a_forged_table_summary_naming_a_gs_endpoint_override_sends_no_request(trust):
    trust["requests"].clear()
    body, page = _run(trust, "table_gs")
    assert trust["requests"] == [], "the api-server sent a request to the summary's endpoint"
    assert (
        f"the manifest its summary names is refused, and nothing of it is read: {trust['tables']['table_gs']!r} "
        "holds a query"
    ) in body["problem"]
    assert f"runs are read only below the connection's roots (stage_root {trust['stage']}," in body["problem"]
    assert body["manifest"] is None and "does not read this run" in page
    assert _opened_outside(trust) == []


def test_a_table_manifest_naming_a_run_directory_outside_the_roots_is_refused_unread(trust):
    body, page = _run(trust, "table_pointing")
    assert (
        f"the run directory its manifest names is refused, and nothing of it is read: "
        f"{trust['tables']['table_pointing']} is outside the connection's roots (stage_root {trust['stage']},"
    ) in body["problem"], body
    assert body["manifest"] is None and body["errors"] == [] and "does not read this run" in page
    assert _opened_outside(trust) == []


@pytest.mark.parametrize("name", ["table_outside", "table_gs", "table_pointing"])
def test_the_sensor_and_its_trigger_fail_for_good_on_a_forged_table_run(trust, name):
    """Both read with the connection's roots: a permanent failure naming the location and the roots,
    no storage handle outside the stage and no request to the listener."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_batchinfer import SuccessMarkerSensor
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger

    location = f"iceberg://{FORGED_TABLE}/{name}"
    named = trust["tables"][name]
    trust["requests"].clear()
    trust["built"].clear()
    sensor = SuccessMarkerSensor(task_id=f"wait_{name}", location=location, deferrable=False)
    with pytest.raises(AirflowFailException) as info:
        sensor.poke({})
    message = str(info.value)
    assert message.startswith(f"{location} has a _SUCCESS marker that does not hold: {location} (snapshot "), message
    assert "is refused, and nothing of it is read: " in message and repr(named)[1:-1] in message
    assert f"the connection's roots (stage_root {trust['stage']}, registry_root " in message
    assert message.endswith("Waiting will not fix it: re-run the task that writes this run directory")

    event = asyncio.run(SuccessMarkerTrigger(location=location, poll_interval=0.2).run().__anext__()).payload
    assert event["status"] == "failed" and "is refused, and nothing of it is read: " in event["message"], event
    assert f"the connection's roots (stage_root {trust['stage']}, registry_root " in event["message"]
    assert trust["requests"] == [] and _opened_outside(trust) == []
    assert SECRET not in message + event["message"]
