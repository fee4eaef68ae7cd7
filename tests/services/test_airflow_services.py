"""Airflow for real: api-server, scheduler, dag-processor and triggerer (LocalExecutor, SQLite) on
127.0.0.1, driven only through the REST API and the CLI, as users touch them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.store.locations import sanitize_run_key
from tests.airflow_services import AirflowServices, services_env
from tests.conftest import REPO, _free_port
from tests.models import SlowLength, TextLength, committed_manifest, write_tickets

TIMINGS: dict[str, float] = {}

# The DAG files the scenarios run, and no other: the dag-processor parses each in a process of its
# own (2-3 CPU-seconds), and every other file in the bundles would be parsed for nothing
DAG_FILES = (
    REPO / "example_dags" / "batchinfer_ticket_embeddings.py",
    REPO / "tests" / "dags" / "batchinfer_services_dags.py",
    REPO / "tests" / "dags" / "assets" / "batchinfer_asset_dags.py",
    REPO / "tests" / "dags" / "batchinfer_ui_dags.py",
)
# users of the services' auth manager (tests/ui_auth.py): every request signs in; OUTSIDER may not
# read UI_DENIED_DAG
PASSWORDS = {"admin": "admin-pw", "outsider": "outsider-pw"}
UI_DENIED_DAG = "bi_ui_iceberg"


def _scenario_bundle(root) -> list[dict]:
    """One bundle of links to ``DAG_FILES``, listed once: no file is added while the services run."""
    folder = root / "dags"
    folder.mkdir()
    for path in DAG_FILES:
        (folder / path.name).symlink_to(path)
    return [
        {
            "name": "batchinfer_services",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(folder), "refresh_interval": 3600},
        }
    ]


def _tests_only_path(root: Path) -> Path:
    """A directory holding only ``tests`` (a link to the repository's), for the services' PYTHONPATH.

    The repository's root on the path would also put the ``*.egg-info`` an editable install leaves
    there on it: Airflow then finds the provider's ``airflow.plugins`` entry point twice, and its task
    runner stops registering plugins at the first repeated name, so the OpenLineage listener that
    comes after it never runs in the tasks."""
    path = root / "pythonpath"
    path.mkdir(exist_ok=True)
    (path / "tests").symlink_to(REPO / "tests", target_is_directory=True)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory, ray_cluster):
    """Services plus what they need: a stage + registry with two models, an input, connections. One
    set for every scenario: the scheduler's own scheduling is on (the asset pair's publish DAG is
    triggered by it), and no clock-scheduled run competes with the scenarios (``services_env``)."""
    from airflow_provider_batchinfer.registry import ModelRegistry

    root = tmp_path_factory.mktemp("services")
    home, bi_home = root / "airflow", root / "batchinfer"
    home.mkdir()
    registry = ModelRegistry(str(bi_home / "registry"))
    sig = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
    registry.log_model("text_length", "v1", "python", python_class=TextLength, signature=sig)
    registry.log_model("slow_length", "v1", "python", python_class=SlowLength, signature=sig)
    inputs = write_tickets(root / "input", rows=400, files=2)
    cluster_conn = {
        "conn_type": "batchinfer",
        "host": ray_cluster["dashboard"],
        "extra": {
            "launcher": "ray_jobs",
            "python": __import__("sys").executable,
            "ray_token": ray_cluster["token"],
            "stage_root": str(bi_home / "stage"),
            "registry_root": str(bi_home / "registry"),
        },
    }
    port = _free_port()
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps(PASSWORDS))
    env = services_env(
        home,
        port,
        _scenario_bundle(root),
        {
            "BATCHINFER_HOME": str(bi_home),
            "AIRFLOW_VAR_BI_SVC_INPUT": str(inputs),
            "AIRFLOW_CONN_BATCHINFER_CLUSTER": json.dumps(cluster_conn),
            # the same cluster with prices: the batch runs pages show what a run cost
            "AIRFLOW_CONN_BATCHINFER_UI": json.dumps(
                {**cluster_conn, "extra": {**cluster_conn["extra"], "price_per_cpu_hour": 0.05}}
            ),
            "AIRFLOW__CORE__AUTH_MANAGER": "tests.ui_auth.DenyOneDagAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,outsider:viewer",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "BATCHINFER_TEST_DENIED": f"outsider:{UI_DENIED_DAG}",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(_tests_only_path(root)), os.environ.get("PYTHONPATH", "")) if p
            ),
            # Airflow's OpenLineage listener, writing every event it emits to a file (one JSON a line)
            "AIRFLOW__OPENLINEAGE__DISABLED": "False",
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "batchinfer-services",
            # the task process waits this long for an event's emission before dropping it (10 s by
            # default: too short on 2 cores shared with the rest of the suite)
            "AIRFLOW__OPENLINEAGE__EXECUTION_TIMEOUT": "120",
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                {"type": "file", "log_file_path": str(root / "openlineage.jsonl"), "append": True}
            ),
        },
        asset_triggered_runs=True,
    )
    services = AirflowServices(home, port, env)
    t0 = time.monotonic()
    services.start()
    services.headers = {"Authorization": f"Bearer {services.login('admin', PASSWORDS['admin'])}"}
    for dag_id in (
        "batchinfer_ticket_embeddings",
        "bi_svc_retry",
        "bi_svc_error_daily",
        "bi_svc_ray_jobs",
        "bi_svc_ray_jobs_daily",
        "bi_svc_sensor_wait",
        "bi_test_asset_producer",
        "bi_test_asset_publisher",
        "bi_ui_dead_letters",
        UI_DENIED_DAG,
    ):
        services.wait_for_dag(dag_id)
    TIMINGS["start services and parse DAGs"] = time.monotonic() - t0
    yield {
        "services": services,
        "root": root,
        "stage": bi_home / "stage",
        "inputs": inputs,
        "registry": bi_home / "registry",
        "cluster": ray_cluster,
    }
    t0 = time.monotonic()
    services.stop()
    TIMINGS["stop services"] = time.monotonic() - t0
    print("\nscenario wall times:", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))
    if services.restarts:
        print("components started again:", "; ".join(services.restarts))


def openlineage_events(world, job: str, event_type: str) -> list[dict]:
    """The OpenLineage events the listener emitted for ``<dag_id>.<task_id>``."""
    path = world["root"] / "openlineage.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [e for e in events if e.get("job", {}).get("name") == job and e.get("eventType") == event_type]


def test_the_provider_as_the_ui_sees_it(world):
    s = world["services"]
    t0 = time.monotonic()
    providers = s.api("GET", "/providers", params={"limit": 100})["providers"]
    assert "airflow-provider-batchinfer" in {p["package_name"] for p in providers}
    assert s.api("GET", "/importErrors")["total_entries"] == 0
    meta = {m["connection_type"]: m for m in s.api("GET", "/connections/hook_meta", prefix="/ui")}
    form = meta["batchinfer"]
    assert form["hook_name"] == "Batch Inference Model Service"
    assert {"stage_root", "registry_root", "launcher"} <= set(form["extra_fields"])
    tested = s.api(
        "POST",
        "/connections/test",
        json={
            "connection_id": "ui_test",
            "conn_type": "batchinfer",
            "extra": json.dumps(
                {"stage_root": str(world["root"] / "ui-stage"), "registry_root": str(world["root"] / "ui-reg")}
            ),
        },
    )
    assert tested["status"] is True, tested
    TIMINGS["provider, connection form, connection test"] = time.monotonic() - t0


def test_rest_trigger_of_the_embeddings_dag(world):
    s = world["services"]
    t0 = time.monotonic()
    run_id = s.trigger("batchinfer_ticket_embeddings", {"num_tickets": 64})
    assert s.wait_for_run("batchinfer_ticket_embeddings", run_id) == "success", s.task_states(
        "batchinfer_ticket_embeddings", run_id
    )
    run_dir = world["stage"] / "embeddings" / "tickets" / sanitize_run_key(run_id)
    manifest = committed_manifest(str(run_dir))
    assert manifest["counts"] == {"input_rows": 64, "output_rows": 64, "error_rows": 0}
    assert manifest["model"]["name"] == "ticket_embedder" and len(manifest["model"]["sha256"]) == 64
    assert manifest["airflow"]["dag_id"] == "batchinfer_ticket_embeddings" and manifest["airflow"]["run_id"] == run_id
    table = pq.read_table([str(run_dir / f["name"]) for f in manifest["files"]])
    assert table.column_names == ["ticket_id", "embedding"]
    assert sorted(table.column("ticket_id").to_pylist()) == list(range(1, 65))
    assert len(table.column("embedding")[0]) == 384
    xcoms = f"/dags/batchinfer_ticket_embeddings/dagRuns/{run_id}/taskInstances/embed_tickets/xcomEntries"
    out = s.api("GET", f"{xcoms}/return_value", params={"deserialize": True})["value"]
    assert out["output_location"] == str(run_dir) and out["rows"] == 64
    location = s.api("GET", f"{xcoms}/output_location", params={"deserialize": True})["value"]
    assert location == str(run_dir)
    report = world["stage"] / "published" / "ticket_embeddings" / sanitize_run_key(run_id) / "report.json"
    assert json.loads(report.read_text())["rows"] == 64 and json.loads(report.read_text())["dimensions"] == 384

    # what Airflow's OpenLineage listener emitted for the inference task: input, model and output
    # datasets under the naming spec's namespaces, with schemas, statistics and the model facet
    (event,) = [
        e
        for e in openlineage_events(world, "batchinfer_ticket_embeddings.embed_tickets", "COMPLETE")
        if e["run"]["facets"]["airflow"]["dagRun"]["run_id"] == run_id
    ]
    (input_location,) = manifest["input"]["locations"]
    data, model = event["inputs"]
    assert (data["namespace"], data["name"]) == ("file", input_location)
    assert {"ticket_id", "text"} <= {f["name"] for f in data["facets"]["schema"]["fields"]}
    assert data["inputFacets"]["inputStatistics"]["rowCount"] == 64
    assert (model["namespace"], model["name"]) == (
        "file",
        str(world["registry"] / "ticket_embedder" / "all-minilm-l6-v2"),
    )
    (output,) = event["outputs"]
    assert (output["namespace"], output["name"]) == ("file", str(run_dir))
    assert [f["name"] for f in output["facets"]["schema"]["fields"]] == ["ticket_id", "embedding"]
    assert output["outputFacets"]["outputStatistics"] == {
        **output["outputFacets"]["outputStatistics"],
        "rowCount": 64,
        "fileCount": len(manifest["files"]),
        "size": sum(f["size"] for f in manifest["files"]),
    }
    facet = event["run"]["facets"]["batchinference"]
    assert facet["model"] == {k: manifest["model"][k] for k in ("name", "version", "flavor", "sha256")}
    assert facet["job"]["attempt"] == manifest["job"]["attempt"] and facet["counts"] == manifest["counts"]
    # the START event already names the inputs and the model (the run directory needs the run)
    (start,) = [
        e
        for e in openlineage_events(world, "batchinfer_ticket_embeddings.embed_tickets", "START")
        if e["run"]["runId"] == event["run"]["runId"]
    ]
    assert [(d["namespace"], d["name"]) for d in start["inputs"]] == [
        (d["namespace"], d["name"]) for d in event["inputs"]
    ]
    TIMINGS["REST trigger, embeddings DAG"] = time.monotonic() - t0


def _backfill(s, dag_id: str, first: str, last: str, expected: int, known: set[str]) -> tuple[list[str], float]:
    """Create a backfill of ``first``..``last`` with up to ``expected`` runs at once; wait until its
    ``expected`` new runs end. Returns them and the wall time from the create to the last run's end."""
    t0 = time.monotonic()
    s.create_backfill(dag_id, first, last, max_active_runs=expected)
    new_runs = lambda: sorted(  # noqa: E731
        r["dag_run_id"] for r in s.runs(dag_id) if r["run_type"] == "backfill" and r["dag_run_id"] not in known
    )
    deadline = time.monotonic() + 60
    while len(new_runs()) < expected and time.monotonic() < deadline:
        time.sleep(1)
    runs = new_runs()
    assert len(runs) == expected, runs
    for run_id in runs:
        assert s.wait_for_run(dag_id, run_id, timeout=600) == "success", s.task_states(dag_id, run_id)
    return runs, time.monotonic() - t0


def _ray_jobs_of(world, dag_id: str) -> dict[str, list]:
    """The session cluster's jobs for a DAG, by run id (from the metadata every submission carries)."""
    from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher

    cluster = world["cluster"]
    client = RayJobsLauncher(cluster["dashboard"], headers={"Authorization": f"Bearer {cluster['token']}"}).client()
    jobs: dict[str, list] = {}
    for job in client.list_jobs():
        if (job.metadata or {}).get("dag_id") == dag_id:
            jobs.setdefault(job.metadata["run_id"], []).append(job)
    return jobs


def _stop_running_jobs(world, dag_id: str) -> None:
    from airflow_provider_batchinfer.launchers.ray_jobs import TERMINAL, RayJobsLauncher

    cluster = world["cluster"]
    launcher = RayJobsLauncher(cluster["dashboard"], headers={"Authorization": f"Bearer {cluster['token']}"})
    for jobs in _ray_jobs_of(world, dag_id).values():
        for job in jobs:
            if str(getattr(job.status, "value", job.status)) not in TERMINAL:
                launcher.stop_job(job.submission_id)


def _peak_overlap(jobs: list) -> int:
    """How many of the jobs ran at once at most (from the cluster's start and end times)."""
    edges = sorted([(j.start_time, 1) for j in jobs] + [(j.end_time, -1) for j in jobs])
    peak = current = 0
    for _t, step in edges:
        current += step
        peak = max(peak, current)
    return peak


def _reprocess(s, dag_id: str, first: str, last: str, runs: list[str], attempt_of) -> None:
    """A reprocess backfill of ``first``..``last`` (reprocess behavior ``completed``): the same run
    ids run again. Seen under load on SQLite: a reprocess backfill that closes without taking one of
    the runs; then it is created again, as an operator would."""
    for _ in range(3):
        s.wait_for_backfills(dag_id)
        s.create_backfill(dag_id, first, last, reprocess="completed", max_active_runs=len(runs))
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            if all(attempt_of(r) for r in runs):
                return
            if _backfills_closed(s, dag_id) and all(
                s.api("GET", f"/dags/{dag_id}/dagRuns/{r}")["state"] == "success" for r in runs
            ):
                break
            time.sleep(1)
        if all(attempt_of(r) for r in runs):
            return


# its own waits allow more than the suite's 600 s default (421 s seen on a loaded fresh clone)
@pytest.mark.timeout(1200)
def test_backfill_two_dates_at_once_then_reprocess_them_with_overwrite(world):
    """2 logical dates with max_active_runs=2, each run deferred while its job runs on the one 2-CPU
    cluster through the Jobs API: every run commits exactly once (one _SUCCESS, one attempt, all
    rows), and the two jobs run at once. Then a reprocess backfill of the same dates: the same run
    ids run again and OVERWRITE replaces each run directory with exactly the new attempt's parts."""
    s = world["services"]
    dag_id = "bi_svc_ray_jobs_daily"
    base = world["stage"] / "svc" / "ray_jobs_daily"
    try:
        runs, TIMINGS["ray_jobs backfill, 2 dates, max_active_runs=2"] = _backfill(
            s, dag_id, "2026-11-01", "2026-11-02", 2, set()
        )
    finally:  # jobs that stalled must not hold the cluster for the scenarios after this one
        _stop_running_jobs(world, dag_id)
    jobs = _ray_jobs_of(world, dag_id)
    first = {}
    for run_id in runs:
        assert s.task_states(dag_id, run_id)["infer"] == ("success", 1)
        manifest = _one_clean_commit(base / sanitize_run_key(run_id))
        assert manifest["job"]["attempt"].startswith("t01") and manifest["job"]["launcher"] == "ray_jobs"
        first[run_id] = manifest["job"]["attempt"]
        assert len(jobs[run_id]) == 1, jobs[run_id]  # one Ray job per run
    # the runs' jobs shared the cluster: both ran at once (each task deferred while its job ran)
    peak = _peak_overlap([jobs[r][0] for r in runs])
    TIMINGS["ray_jobs backfill, peak concurrent jobs"] = peak
    assert peak == 2, [(j.start_time, j.end_time) for r in runs for j in jobs[r]]

    def replaced(run_id: str) -> bool:
        try:
            manifest = committed_manifest(str(base / sanitize_run_key(run_id)))
        except Exception:  # the marker went away between listing and reading: OVERWRITE at work
            return False
        return bool(manifest) and manifest["job"]["attempt"] != first[run_id]

    t0 = time.monotonic()
    try:
        _reprocess(s, dag_id, "2026-11-01", "2026-11-02", runs, replaced)
        # each new attempt's marker is there, and its job may still be ending: a job stopped now
        # ends STOPPED and fails its run, so the runs end before anything is stopped
        states = {run_id: s.wait_for_run(dag_id, run_id) for run_id in runs}
    finally:
        _stop_running_jobs(world, dag_id)
    assert set(states.values()) == {"success"}, states
    for run_id in runs:
        assert replaced(run_id), run_id
        _one_clean_commit(base / sanitize_run_key(run_id))
    TIMINGS["ray_jobs backfill reprocess, OVERWRITE"] = time.monotonic() - t0


def _one_clean_commit(run_dir) -> dict:
    """The run directory holds one commit: 400 rows, each input row exactly once, and no part file
    but those its manifest lists."""
    manifest = committed_manifest(str(run_dir))
    assert manifest["counts"] == {"input_rows": 400, "output_rows": 400, "error_rows": 0}
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("part-")) == sorted(
        f["name"] for f in manifest["files"]
    )
    ids = pq.read_table([str(run_dir / f["name"]) for f in manifest["files"]]).column("ticket_id").to_pylist()
    assert sorted(ids) == list(range(400))  # every row exactly once
    return manifest


def _backfills_closed(s, dag_id: str) -> bool:
    return all(b.get("completed_at") for b in s.api("GET", "/backfills", params={"dag_id": dag_id})["backfills"])


def test_backfill_reprocess_is_refused_in_error_mode(world):
    s = world["services"]
    t0 = time.monotonic()
    dag_id = "bi_svc_error_daily"
    s.create_backfill(dag_id, "2026-11-05", "2026-11-05")
    deadline = time.monotonic() + 60
    while not s.runs(dag_id) and time.monotonic() < deadline:
        time.sleep(1)
    (run,) = s.runs(dag_id)
    assert s.wait_for_run(dag_id, run["dag_run_id"]) == "success"
    run_dir = world["stage"] / "svc" / "error_daily" / sanitize_run_key(run["dag_run_id"])
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    first_try = s.task_states(dag_id, run["dag_run_id"])["infer"][1]
    # a reprocess backfill clears the run and the scheduler runs it again. Seen once under heavy
    # load on SQLite: the backfill closed without taking the run (it stayed at its first try); then
    # the scenario creates it again rather than wait for a re-run that never comes
    for _ in range(3):
        s.wait_for_backfills(dag_id)
        s.create_backfill(dag_id, "2026-11-05", "2026-11-05", reprocess="completed")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            state, tries = s.task_states(dag_id, run["dag_run_id"])["infer"]
            if state == "failed":
                break
            if state == "success" and tries == first_try and _backfills_closed(s, dag_id):
                break
            time.sleep(1)
        if state == "failed":
            break
    assert s.task_states(dag_id, run["dag_run_id"])["infer"][0] == "failed"
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    # the FAIL event names the directory it refused to touch, without the earlier run's statistics
    fails = [
        e
        for e in openlineage_events(world, f"{dag_id}.infer", "FAIL")
        if e["run"]["facets"]["airflow"]["dagRun"]["run_id"] == run["dag_run_id"]
    ]
    assert fails, "no OpenLineage FAIL event for the refused re-run"
    (output,) = fails[-1]["outputs"]
    assert (output["namespace"], output["name"]) == ("file", str(run_dir)) and not output.get("outputFacets")
    TIMINGS["backfill reprocess refused, ERROR"] = time.monotonic() - t0


def test_an_injected_fault_is_retried_by_the_scheduler(world, tmp_path):
    s = world["services"]
    t0 = time.monotonic()
    flag = tmp_path / "fail-once"
    flag.write_text("x")
    tickets = write_tickets(tmp_path / "input", rows=300, files=3, fail_once_flag=flag)
    out = tmp_path / "out"
    run_id = s.trigger("bi_svc_retry", {"input": str(tickets), "out": str(out)})
    assert s.wait_for_run("bi_svc_retry", run_id) == "success"
    assert s.task_states("bi_svc_retry", run_id)["infer"] == ("success", 2)
    manifest = committed_manifest(str(out))
    assert manifest["counts"]["output_rows"] == 300 and manifest["job"]["attempt"].startswith("t02")
    assert sorted(p.name for p in out.glob("part-*.parquet")) == sorted(f["name"] for f in manifest["files"])
    TIMINGS["scheduler retry after injected fault"] = time.monotonic() - t0


def test_deferred_inference_and_sensor_are_resumed_by_the_triggerer(world, tmp_path):
    s = world["services"]
    t0 = time.monotonic()
    out = tmp_path / "out"
    run_id = s.trigger("bi_svc_ray_jobs", {"input": str(world["inputs"]), "out": str(out)})
    seen_deferred = False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not seen_deferred:
        seen_deferred = s.task_states("bi_svc_ray_jobs", run_id).get("infer", ("", 0))[0] == "deferred"
        time.sleep(1)
    assert seen_deferred, "the inference task never deferred"
    # live logs: while the task is still deferred, its log (as the UI reads it) shows the job's progress
    progress_while_deferred = False
    while not progress_while_deferred and s.task_states("bi_svc_ray_jobs", run_id)["infer"][0] == "deferred":
        log = s.api("GET", f"/dags/bi_svc_ray_jobs/dagRuns/{run_id}/taskInstances/infer/logs/1")
        still_deferred = s.task_states("bi_svc_ray_jobs", run_id)["infer"][0] == "deferred"
        progress_while_deferred = still_deferred and "[batchinfer] progress:" in json.dumps(log)
        time.sleep(0.5)
    assert progress_while_deferred, "no progress line in the task log while the job ran"
    assert s.wait_for_run("bi_svc_ray_jobs", run_id) == "success", s.task_states("bi_svc_ray_jobs", run_id)
    assert committed_manifest(str(out))["job"]["launcher"] == "ray_jobs"
    links = s.api("GET", f"/dags/bi_svc_ray_jobs/dagRuns/{run_id}/taskInstances/infer/links")
    assert "/#/jobs/batchinfer-bi_svc_ray_jobs-infer-" in json.dumps(links)

    # a sensor that has to wait: it defers, the marker appears, the triggerer resumes it
    location = tmp_path / "later"
    run_id = s.trigger("bi_svc_sensor_wait", {"location": str(location)})
    deadline = time.monotonic() + 120
    while s.task_states("bi_svc_sensor_wait", run_id).get("gate", ("", 0))[0] != "deferred":
        assert time.monotonic() < deadline, s.task_states("bi_svc_sensor_wait", run_id)
        time.sleep(0.5)
    s.wait_for_defer_exit("bi_svc_sensor_wait", run_id, "gate")
    from tests.e2e.test_sensor import commit

    commit(location)
    assert s.wait_for_run("bi_svc_sensor_wait", run_id) == "success"
    TIMINGS["deferred inference + sensor via triggerer"] = time.monotonic() - t0


def test_a_publish_dag_runs_on_the_inference_dags_asset(world, tmp_path):
    """The inference DAG commits; its Asset event triggers the publish DAG, which finds the run
    directory in its triggering event (it is never told the upstream run id) and publishes exactly
    the committed rows."""
    s = world["services"]
    t0 = time.monotonic()
    inputs = write_tickets(tmp_path / "in", rows=400, files=2)
    run_id = s.trigger("bi_test_asset_producer", {"input": str(inputs)})
    assert s.wait_for_run("bi_test_asset_producer", run_id) == "success", s.task_states(
        "bi_test_asset_producer", run_id
    )
    deadline = time.monotonic() + 120
    while not s.runs("bi_test_asset_publisher"):
        assert time.monotonic() < deadline, "the publish DAG was not triggered by the asset event"
        time.sleep(1)
    (publish,) = s.runs("bi_test_asset_publisher")
    assert publish["run_type"] == "asset_triggered" and not publish["conf"]  # nothing handed over but the event
    assert s.wait_for_run("bi_test_asset_publisher", publish["dag_run_id"]) == "success", s.task_states(
        "bi_test_asset_publisher", publish["dag_run_id"]
    )
    run_dir = world["stage"] / "svc" / "assets" / sanitize_run_key(run_id)
    manifest = committed_manifest(str(run_dir))
    committed = pq.read_table([str(run_dir / f["name"]) for f in manifest["files"]])
    published = pq.read_table(world["stage"] / "svc" / "published" / f"{sanitize_run_key(run_id)}.parquet")
    assert committed.num_rows == 400 and published.sort_by("ticket_id").equals(committed.sort_by("ticket_id"))
    # the event that triggered the publish run, as the REST API (and the UI) shows it
    (event,) = s.api("GET", f"/dags/bi_test_asset_publisher/dagRuns/{publish['dag_run_id']}/upstreamAssetEvents")[
        "asset_events"
    ]
    assert event["source_run_id"] == run_id and event["extra"]["run_dir"] == str(run_dir)
    assert event["extra"]["rows"] == 400 and event["extra"]["sha256"] == manifest["model"]["sha256"]
    # the scheduler's own scheduling created that run, and no clock-scheduled one (services_env)
    assert s.api("GET", "/dags/~/dagRuns", params={"run_type": "scheduled"})["total_entries"] == 0
    TIMINGS["asset-triggered publish after a commit"] = time.monotonic() - t0


# --- the batch runs pages (airflow_provider_batchinfer/ui) -----------------------------------------------
UI_RUNS: dict[str, dict] = {}


def _ui(s, path: str, **kwargs):
    return s.api("GET", path, prefix="/batchinfer/api", **kwargs)


def test_the_batch_runs_pages_show_each_run_as_its_manifest_says(world, tmp_path):
    """Two runs through the scheduler (one dead-letters a row, one commits into an Iceberg table): the
    plugin's JSON shows each with the figures of its manifest, read independently from storage here;
    a user who may not read one DAG sees none of its runs and gets the core API's 403; no token, 401."""
    import requests

    from airflow_provider_batchinfer.contract.tables import TABLE_MANIFEST_FILE

    s = world["services"]
    # the api-server loaded the plugin from the provider's entry point, with its nav entry
    ours = next(p for p in s.api("GET", "/plugins")["plugins"] if p["name"] == "batchinfer")
    assert ours["external_views"][0]["href"] == "batchinfer/runs"
    assert ours["fastapi_apps"][0]["url_prefix"] == "/batchinfer"
    t0 = time.monotonic()
    bad = write_tickets(tmp_path / "bad", rows=60, files=2, bad_row=7)
    out = world["stage"] / "ui_dead_letters"  # the run page reads only below the connection's stage_root
    runs = {
        "bi_ui_dead_letters": s.trigger("bi_ui_dead_letters", {"input": str(bad), "out": str(out)}),
        UI_DENIED_DAG: s.trigger(UI_DENIED_DAG, {"input": str(world["inputs"])}),
    }
    for dag_id, run_id in runs.items():
        assert s.wait_for_run(dag_id, run_id) == "success", s.task_states(dag_id, run_id)
    TIMINGS["ui: a dead-letter run and an Iceberg run"] = time.monotonic() - t0
    listed = {r["dag_id"]: r for r in _ui(s, "/runs", params={"limit": 200})["runs"] if r["dag_id"] in runs}
    assert {d: r["run_id"] for d, r in listed.items()} == runs
    for dag_id, row in listed.items():
        params = {k: row[k] for k in ("dag_id", "task_id", "run_id", "map_index")}
        detail = _ui(s, "/run", params=params)
        assert detail["problem"] is None, detail
        if dag_id == UI_DENIED_DAG:
            run_dir = detail["manifest"]["run_dir"].removeprefix("file:")  # a table's data directory, as a URI
            manifest = json.loads((Path(run_dir) / TABLE_MANIFEST_FILE).read_text())
            assert detail["manifest"]["table"]["identifier"] == "ui.ticket_lengths"
            assert isinstance(detail["manifest"]["table"]["snapshot_id"], int)
        else:
            manifest = committed_manifest(str(out))
            assert manifest["counts"]["error_rows"] == 1 and len(detail["errors"]) == 1
            assert "cannot score text 'boom'" in detail["errors"][0]["error"]
        counts, model, usage = manifest["counts"], manifest["model"], manifest["usage"]
        assert (row["input_rows"], row["output_rows"], row["error_rows"]) == (
            counts["input_rows"],
            counts["output_rows"],
            counts["error_rows"],
        )
        assert (row["model"], row["model_version"], row["sha256"]) == (model["name"], model["version"], model["sha256"])
        assert (row["wall_s"], row["cpu_seconds"], row["cost"]) == (
            usage["wall_s"],
            usage["cpu_seconds"],
            usage["cost"],
        )
        assert row["cost"] > 0 and row["rows_per_s"] == usage["rows_per_s"]
        assert detail["manifest"]["counts"] == counts
        assert [f["sha256"] for f in detail["manifest"]["files"]] == [f["sha256"] for f in manifest["files"]]
        assert world["cluster"]["token"] not in json.dumps(detail)  # no connection extras, no credentials
        UI_RUNS[dag_id] = row
    trends = _ui(s, "/trends", params={"dag_id": "bi_ui_dead_letters", "task_id": "infer"})
    assert trends["points"][-1]["error_fraction"] == 1 / 60

    outsider = {"Authorization": f"Bearer {s.login('outsider', PASSWORDS['outsider'])}"}
    seen = {r["dag_id"] for r in _ui(s, "/runs", params={"limit": 200}, headers=outsider)["runs"]}
    assert "bi_ui_dead_letters" in seen and UI_DENIED_DAG not in seen
    denied = {k: listed[UI_DENIED_DAG][k] for k in ("dag_id", "task_id", "run_id")}
    for path, params in (
        (f"/api/v2/dags/{UI_DENIED_DAG}/dagRuns", {}),  # the core API's answer, which the plugin's must equal
        ("/batchinfer/api/runs", {"dag_id": UI_DENIED_DAG}),
        ("/batchinfer/api/run", denied),
        ("/batchinfer/run", denied),
        ("/batchinfer/trends", {"dag_id": UI_DENIED_DAG, "task_id": "score"}),
    ):
        response = requests.get(f"{s.base}{path}", params=params, headers=outsider, timeout=60)
        assert response.status_code == 403, (path, response.status_code, response.text[:300])
    for path in ("/batchinfer/api/runs", "/batchinfer/runs", "/batchinfer/api/run"):
        response = requests.get(f"{s.base}{path}", params=denied, timeout=60)
        assert response.status_code == 401, (path, response.status_code, response.text[:300])
    TIMINGS["ui: pages and permissions"] = time.monotonic() - t0


def _screenshots_module():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("ui_screenshots", REPO / "scripts" / "ui_screenshots.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_batch_runs_pages_in_headless_chromium(world):
    """Debian's Chromium loads the batch-runs page (light and dark), a run's page and a trend, signed in
    with the admin's token as Airflow's cookie; the screenshots go to docs/screenshots/services/
    (``scripts/ui_screenshots.py --demo`` takes the ones in docs/screenshots/ from demo runs).
    ``make test`` installs Chromium beside the suite where it can; this looks for it when it runs."""
    if not Path("/usr/bin/chromium").exists():
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    assert set(UI_RUNS) == {"bi_ui_dead_letters", UI_DENIED_DAG}, "needs the runs of the test before"
    s = world["services"]
    t0 = time.monotonic()
    token = s.headers["Authorization"].removeprefix("Bearer ")
    shots = _screenshots_module().take_all(
        s.base, token, UI_RUNS["bi_ui_dead_letters"], REPO / "docs" / "screenshots" / "services"
    )
    for shot in shots:
        assert shot.problem is None and not shot.traceback, shot
        assert shot.path.stat().st_size > 10_000, shot
        print(f"{shot.path.name}: {shot.heading!r}, {shot.rows} row(s), loaded in {shot.load_s:.2f} s")
    for shot in shots[:2]:
        assert {r["run_id"] for r in UI_RUNS.values()} <= set(shot.run_ids), shot
    assert shots[2].heading.startswith("bi_ui_dead_letters")
    TIMINGS["ui: screenshots in chromium"] = time.monotonic() - t0
