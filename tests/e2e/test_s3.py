"""``s3://`` stages, inputs and registries against a real S3 HTTP server (``moto_server`` on
127.0.0.1, a separate process), with real Ray and Airflow's ``dag.test()`` for the end-to-end runs.

Credentials come only from a ``batchinfer`` connection defined through ``AIRFLOW_CONN_...``; the
tests check that its secret shows up in none of ``_job.json``, the manifest, XCom or the log.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, FileEntry, RunOwner, part_name
from airflow_provider_batchinfer.registry.fetch import cached_copy
from airflow_provider_batchinfer.store.commit.rundir import clear_run_directory
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.locations import sanitize_run_key
from airflow_provider_batchinfer.store.s3 import S3StageError, check_bucket
from airflow_provider_batchinfer.store.stage import Stage
from tests.conftest import run_dag, xcom_value
from tests.runs import job_file, manifest_for, parquet_bytes

SECRET = "s3cr3t-Do-Not-Leak-9f2c"
KEY_ID = "AKIDBATCHINFERTEST"


def options(endpoint: str) -> dict:
    return {
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "access_key": KEY_ID,
        "secret_key": SECRET,
        "max_attempts": 2,
    }


def put(endpoint: str, location: str, data: bytes) -> None:
    Stage.open(location, options(endpoint)).write_bytes(data)


def keys(endpoint: str, location: str) -> list[str]:
    return [name for name, _ in Stage.open(location, options(endpoint)).list_files()]


@pytest.fixture
def s3_connection(s3_server, s3_bucket, monkeypatch):
    """``batchinfer_default`` on the S3 server: stage and registry both in the test's bucket."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCHINFER_DEFAULT",
        json.dumps(
            {
                "conn_type": "batchinfer",
                "login": KEY_ID,
                "password": SECRET,
                "extra": {
                    "endpoint_url": s3_server,
                    "region_name": "us-east-1",
                    "s3_max_attempts": 2,
                    "stage_root": f"s3://{s3_bucket}/stage",
                    "registry_root": f"s3://{s3_bucket}/registry",
                },
            }
        ),
    )
    # the Airflow process itself has no AWS credentials: they can only come from the connection
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    return f"s3://{s3_bucket}"


@pytest.fixture
def s3_model(s3_server, s3_connection):
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import TextLength

    registry = ModelRegistry(f"{s3_connection}/registry", options(s3_server))
    return registry.log_model(
        "text_length",
        "v1",
        "python",
        python_class=TextLength,
        signature={"inputs": {"text": "string"}, "outputs": {"length": "int64"}},
    )


@pytest.fixture
def s3_tickets(s3_server, s3_connection):
    """500 tickets in 4 Parquet files under ``s3://<bucket>/input/``."""
    table = pa.table(
        {
            "ticket_id": pa.array(range(500), pa.int64()),
            "text": [f"ticket {i}: " + "slow export " * (i % 5) for i in range(500)],
        }
    )
    for n in range(4):
        sink = io.BytesIO()
        pq.write_table(table.slice(n * 125, 125), sink)
        put(s3_server, f"{s3_connection}/input/tickets-{n}.parquet", sink.getvalue())
    return f"{s3_connection}/input", 500


def _openlineage_on_complete(run_id: str, **arguments):
    """What the OpenLineage listener gets from ``bi_test_base_location``'s task once it succeeded: the
    operator with its rendered arguments, asked with the run's real task instance."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec, SaveMode

    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == "bi_test_base_location", TaskInstance.run_id == run_id)
        ).one()
        session.expunge(ti)
    op = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=arguments["input"],
        output_spec=OutputSpec(base_stage_location=arguments["base_stage_location"], mode=SaveMode.OVERWRITE),
    )
    return op.get_openlineage_facets_on_complete(ti)


# --- the stage layer on S3 (no Airflow, no Ray) ---------------------------------------------------------


def test_run1_and_run10_never_touch_each_other(s3_server, s3_bucket):
    for run in ("run1", "run10"):
        for name in (JOB_SPEC_FILE, "part-00000-t01a.parquet", SUCCESS_MARKER):
            put(s3_server, f"s3://{s3_bucket}/out/{run}/{name}", b"x")
    run1 = Stage.open(f"s3://{s3_bucket}/out/run1", options(s3_server))
    assert [n for n, _ in run1.list_files()] == [SUCCESS_MARKER, JOB_SPEC_FILE, "part-00000-t01a.parquet"]
    assert clear_run_directory(run1) == 3
    assert keys(s3_server, f"s3://{s3_bucket}/out/run1") == []
    assert keys(s3_server, f"s3://{s3_bucket}/out/run10") == [SUCCESS_MARKER, JOB_SPEC_FILE, "part-00000-t01a.parquet"]


def test_a_missing_bucket_is_named_and_permanent(s3_server):
    stage = Stage.open("s3://no-such-bucket-here/stage/run1", options(s3_server))
    with pytest.raises(S3StageError, match="S3 bucket 'no-such-bucket-here' does not exist") as info:
        check_bucket(stage.fs, stage.location)
    assert info.value.permanent
    with pytest.raises(
        S3StageError,
        match=r"write failed for bucket 'no-such-bucket-here', key 'stage/run1/_job.json'"
        r".*NO_SUCH_BUCKET",
    ) as info:
        stage.child(JOB_SPEC_FILE).write_json({})
    assert info.value.permanent


def test_a_wrong_endpoint_fails_fast_with_bucket_and_key(s3_bucket):
    from tests.conftest import _free_port

    stage = Stage.open(f"s3://{s3_bucket}/stage/run1", options(f"http://127.0.0.1:{_free_port()}"))
    with pytest.raises(
        S3StageError,
        match=rf"list failed for bucket '{s3_bucket}', key 'stage/run1'.*"
        r"Could not connect",
    ) as info:
        stage.list_files()
    assert info.value.permanent


def test_storage_options_never_carry_credentials_into_the_spec(airflow_db, s3_server, s3_connection):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    hook = ModelServiceHook()
    assert hook.storage_options["secret_key"] == SECRET  # in memory, for the Airflow side
    assert hook.runtime_storage_options() == {"max_attempts": 2, "endpoint_url": s3_server, "region": "us-east-1"}
    assert SECRET not in json.dumps(hook.config.to_dict())
    assert hook.runtime_env() == {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    ok, message = hook.test_connection()
    assert ok, message


def test_ray_workers_get_only_the_aws_variables_of_the_runtime_environment():
    from airflow_provider_batchinfer.store.s3 import worker_env

    env = {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
        "AIRFLOW_CONN_BATCHINFER_DEFAULT": "{...}",
        "HOME": "/root",
        "AWS_SESSION_TOKEN": "",
    }
    assert worker_env(env) == {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
    }


def test_an_aws_conn_id_supplies_what_the_batchinfer_connection_leaves_empty(airflow_db, s3_server, monkeypatch):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    monkeypatch.setenv(
        "AIRFLOW_CONN_MY_AWS",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "AKIDFROMAWS",
                "password": "aws-secret",
                "extra": {"endpoint_url": s3_server, "region_name": "eu-west-1"},
            }
        ),
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_BI_VIA_AWS",
        json.dumps({"conn_type": "batchinfer", "extra": {"aws_conn_id": "my_aws", "region_name": "us-east-1"}}),
    )
    opts = ModelServiceHook("bi_via_aws").storage_options
    assert opts == {
        "access_key": "AKIDFROMAWS",
        "secret_key": "aws-secret",
        "endpoint_url": s3_server,
        "region": "us-east-1",
    }


def test_the_trigger_carries_no_secret_and_reads_an_s3_marker(airflow_db, s3_server, s3_connection):
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger

    location = f"{s3_connection}/stage/committed"
    trigger = SuccessMarkerTrigger(location=location, poke_interval=0.2, deadline=None)
    assert SECRET not in json.dumps(trigger.serialize())

    async def first_event():
        async for event in trigger.run():
            return event.payload

    manifest = commit_on_s3(s3_server, location)
    assert asyncio.run(first_event()) == {"status": "success", "location": location, "manifest": manifest}


def commit_on_s3(endpoint: str, location: str, rows: int = 3) -> dict:
    """A committed run directory on S3: one real part and a manifest listing it; the manifest's dict."""
    run = Stage.open(location, options(endpoint))
    name = part_name(0, "t01abc")
    data = parquet_bytes(list(range(rows)))
    run.child(name).write_bytes(data)
    entry = FileEntry(name=name, size=len(data), rows=rows, sha256=hashlib.sha256(data).hexdigest())
    manifest = manifest_for(location, (entry,), attempt="t01abc")
    run.child(SUCCESS_MARKER).write_bytes(manifest.to_json().encode())
    return manifest.to_dict()


# --- end to end: dag.test() on SQLite, the session's Ray cluster, everything else on the S3 server ---------


def snapshot(endpoint: str, location: str) -> dict[str, int]:
    return dict(Stage.open(location, options(endpoint)).list_files())


@pytest.mark.usefixtures("airflow_db")
def test_end_to_end_input_stage_and_registry_on_s3_then_the_sensors(
    s3_server, s3_connection, s3_model, s3_tickets, capfd
):
    state, tasks, run_id = run_dag("bi_test_base_location", input=s3_tickets[0], out="runs")
    assert state == "success", tasks
    run_dir = f"{s3_connection}/stage/runs/{sanitize_run_key(run_id)}"  # relative: under the S3 stage_root
    manifest = read_valid_manifest(run_dir, options(s3_server)).to_dict()
    assert manifest["counts"] == {"input_rows": 500, "output_rows": 500, "error_rows": 0}
    assert manifest["model"]["uri"] == f"{s3_connection}/registry/text_length/v1"
    fs = Stage.open(run_dir, options(s3_server)).fs
    table = pq.read_table([f"{run_dir[5:]}/{f['name']}" for f in manifest["files"]], filesystem=fs)
    assert sorted(table.column("ticket_id").to_pylist()) == list(range(500))
    xcom = xcom_value("bi_test_base_location", run_id, "infer")
    assert xcom["output_location"] == run_dir and xcom["rows"] == 500
    lineage = _openlineage_on_complete(run_id, input=s3_tickets[0], base_stage_location="runs")

    job_file = Stage.open(run_dir, options(s3_server)).child(JOB_SPEC_FILE).read_bytes().decode()
    marker = Stage.open(run_dir, options(s3_server)).child(SUCCESS_MARKER).read_bytes().decode()
    assert json.loads(job_file)["storage_options"] == {
        "endpoint_url": s3_server,
        "region": "us-east-1",
        "max_attempts": 2,
    }
    from openlineage.client.serde import Serde

    lineage_json = json.dumps(
        [Serde.to_dict(x) for x in [*lineage.inputs, *lineage.outputs, *lineage.run_facets.values()]]
    )
    for text in (job_file, marker, json.dumps(xcom, default=str), lineage_json, capfd.readouterr().out):
        assert SECRET not in text and KEY_ID not in text
    # OpenLineage names S3 datasets s3://<bucket> + key, whatever the endpoint (moto here)
    bucket = s3_connection
    data, model = lineage.inputs
    assert (data.namespace, data.name) == (bucket, "input")
    assert [f.name for f in data.facets["schema"].fields] == ["ticket_id", "text"]
    assert (data.inputFacets["inputStatistics"].rowCount, data.inputFacets["inputStatistics"].fileCount) == (500, 4)
    assert (model.namespace, model.name) == (bucket, "registry/text_length/v1")
    (output,) = lineage.outputs
    assert (output.namespace, output.name) == (bucket, f"stage/runs/{sanitize_run_key(run_id)}")
    assert [(f.name, f.type) for f in output.facets["schema"].fields] == [("ticket_id", "int64"), ("length", "int64")]
    assert output.outputFacets["outputStatistics"].rowCount == 500

    for dag_id in ("bi_test_sensor_poke", "bi_test_sensor_deferrable"):
        state, tasks, sensor_run = run_dag(dag_id, location=run_dir)
        assert state == "success", (dag_id, tasks)
        assert xcom_value(dag_id, sensor_run, "gate") == manifest
    # a marker that lists a missing file fails the sensor at once, naming it
    Stage.open(run_dir, options(s3_server)).child(manifest["files"][0]["name"]).delete()
    state, _, _ = run_dag("bi_test_sensor_poke", location=run_dir)
    assert state == "failed"
    assert f"{run_dir}/{manifest['files'][0]['name']} is listed in _SUCCESS but missing" in capfd.readouterr().out


@pytest.mark.usefixtures("airflow_db")
def test_error_and_overwrite_on_s3_with_1000_plus_stale_objects_and_run10_untouched(
    s3_server, s3_connection, s3_model, s3_tickets, capfd
):
    """ERROR refuses a committed run10; OVERWRITE clears run1 of more objects than one S3 listing
    page or batch delete holds (1,000), and run10, whose prefix starts with run1's, keeps every one."""
    run1, run10 = f"{s3_connection}/out/run1", f"{s3_connection}/out/run10"
    commit_on_s3(s3_server, run10)
    committed = snapshot(s3_server, run10)
    assert SUCCESS_MARKER in committed

    state, _, _ = run_dag("bi_test_error_mode", input=s3_tickets[0], out=run10)  # ERROR: refused, untouched
    assert state == "failed"
    assert f"run directory {run10} is not empty" in capfd.readouterr().out
    assert snapshot(s3_server, run10) == committed

    # run1: an earlier run of the same task left 1,001 parts and a marker
    earlier = job_file(run1, attempt="t01old", owner=RunOwner("bi_test_overwrite_retry", "infer", "earlier", 1))
    put(s3_server, f"{run1}/{JOB_SPEC_FILE}", earlier.to_json().encode())
    _put_many(s3_server, s3_connection[5:], [f"out/run1/part-{i:05d}-t01old.parquet" for i in range(1001)])
    put(s3_server, f"{run1}/{SUCCESS_MARKER}", b"{}")
    state, tasks, _ = run_dag("bi_test_overwrite_retry", input=s3_tickets[0], out=run1)
    assert state == "success", tasks
    manifest = read_valid_manifest(run1, options(s3_server)).to_dict()
    assert manifest["counts"]["output_rows"] == 500
    assert sorted(snapshot(s3_server, run1)) == sorted(
        [JOB_SPEC_FILE, SUCCESS_MARKER, *(f["name"] for f in manifest["files"])]
    )
    assert "removed _SUCCESS then 1002 other file(s)" in capfd.readouterr().out
    assert snapshot(s3_server, run10) == committed


def _put_many(endpoint: str, bucket: str, keys: list[str], connections: int = 4) -> None:
    """Stale objects for a test's setup, put as plain HTTP PUTs on a few kept-alive connections: the
    session's S3 server takes unsigned requests, and signing each of a thousand puts through boto3
    would cost the machine more than the server's own work."""
    import http.client
    from urllib.parse import quote, urlsplit

    host = urlsplit(endpoint)

    def put_some(some: list[str]) -> None:
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=60)
        try:
            for key in some:
                conn.request("PUT", f"/{bucket}/{quote(key)}", body=b"stale")
                response = conn.getresponse()
                response.read()
                assert response.status == 200, (key, response.status)
        finally:
            conn.close()

    with ThreadPoolExecutor(connections) as pool:
        list(pool.map(put_some, [keys[i::connections] for i in range(connections)]))


@pytest.mark.usefixtures("airflow_db")
def test_a_missing_output_bucket_fails_before_anything_is_written(
    s3_server, s3_connection, s3_model, s3_tickets, capfd
):
    state, tasks, _ = run_dag("bi_test_error_mode", input=s3_tickets[0], out="s3://bi-missing-bucket/out/run1")
    assert state == "failed" and tasks["infer"] == ("failed", 1)
    assert (
        "S3 bucket 'bi-missing-bucket' does not exist (location s3://bi-missing-bucket/out/run1)"
        in capfd.readouterr().out
    )


@pytest.mark.usefixtures("airflow_db")
def test_a_wrong_endpoint_fails_the_task_naming_bucket_and_key_and_writes_nothing(
    s3_server, s3_connection, s3_model, s3_tickets, monkeypatch, capfd
):
    from tests.conftest import _free_port

    conn = json.loads(__import__("os").environ["AIRFLOW_CONN_BATCHINFER_DEFAULT"])
    conn["extra"]["endpoint_url"] = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps(conn))
    out = f"{s3_connection}/out/run1"
    state, tasks, _ = run_dag("bi_test_error_mode_retry", input=s3_tickets[0], out=out)
    assert state == "failed" and tasks["infer"] == ("failed", 1)  # permanent: no Airflow retry
    bucket = s3_connection[5:]
    assert (
        f"failed for bucket '{bucket}', key 'registry/text_length/v1/MODEL.json'"
        in (captured := capfd.readouterr().out)
    ) and "Could not connect" in captured
    assert snapshot(s3_server, out) == {}


@pytest.mark.usefixtures("airflow_db")
def test_the_tabular_example_dag_runs_unchanged_through_the_jobs_api_deferrable_with_everything_on_s3(
    s3_server, s3_connection, ray_cluster, tmp_path, monkeypatch, capfd
):
    """The example as shipped, pointed at S3 and at the cluster's Jobs API by the connection alone:
    the model is trained and logged into the S3 registry, data_prep writes the input under the S3
    stage_root, one Ray job (submitted, then watched by its trigger) reads and writes S3, the sensor
    gates on the S3 marker and publish reads only the committed files from S3."""
    import pyarrow.csv as pacsv

    from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher

    cache = tmp_path / "model-cache"
    conn = json.loads(os.environ["AIRFLOW_CONN_BATCHINFER_DEFAULT"])
    conn["host"] = ray_cluster["dashboard"]
    conn["extra"].update(
        launcher="ray_jobs",
        python=sys.executable,
        ray_token=ray_cluster["token"],
        runtime_env={"env_vars": {"BATCHINFER_MODEL_CACHE": str(cache)}},
    )
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps(conn))
    dag_id = "batchinfer_tabular_scoring"
    state, tasks, run_id = run_dag(dag_id, num_customers=1500)
    assert state == "success", tasks
    key = sanitize_run_key(run_id)
    run_dir = f"{s3_connection}/stage/scores/churn/{key}"
    manifest = read_valid_manifest(run_dir, options(s3_server)).to_dict()
    assert manifest["counts"] == {"input_rows": 1500, "output_rows": 1500, "error_rows": 0}
    assert manifest["job"]["launcher"] == "ray_jobs"
    assert manifest["model"]["uri"].startswith(f"{s3_connection}/registry/churn_scorer/sha-")
    assert manifest["input"]["locations"] == [f"{s3_connection}/stage/prepared/customers/{key}"]
    published = Stage.open(f"{s3_connection}/stage/published/churn/{key}/top_100_at_risk.csv", options(s3_server))
    top = pacsv.read_csv(io.BytesIO(published.read_bytes()))
    assert top.num_rows == 100 and top.column_names[0] == "customer_id"
    scores = top.column("churn_probability").to_pylist()
    assert scores == sorted(scores, reverse=True)
    # one submission for the run, and its link on the task
    job_spec = Stage.open(run_dir, options(s3_server)).child(JOB_SPEC_FILE).read_bytes().decode()
    claim = json.loads(job_spec)
    sid = claim["submission_id"]
    launcher = RayJobsLauncher(ray_cluster["dashboard"], headers={"Authorization": f"Bearer {ray_cluster['token']}"})
    ours = [j for j in launcher.client().list_jobs() if (j.metadata or {}).get("run_id") == run_id]
    assert [j.submission_id for j in ours] == [sid]
    assert launcher.find(sid)["status"] == "SUCCEEDED" and len(claim["identity"]) == 64
    assert xcom_value(dag_id, run_id, "score_customers", key="ray_job_url").endswith(f"/#/jobs/{sid}")
    # the actor fetched the S3 model into its node's cache (the one the connection's runtime_env names)
    model = manifest["model"]
    assert (cached_copy(cache, model["uri"], model["sha256"]) / "MODEL.json").exists()
    assert ray_cluster["token"] not in job_spec  # the token never reaches the spec
    assert SECRET not in job_spec and SECRET not in capfd.readouterr().out
