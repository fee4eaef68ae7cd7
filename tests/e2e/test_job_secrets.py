"""Secrets never become metadata: ``ray_jobs`` jobs on a real ``ray start`` cluster, one with S3 keys
on the connection that fails and one with a role that commits, and neither the Jobs API's listing,
the job's metadata, the files the job writes, its XCom nor any task log line (error messages
included) holds the connection's secret or any credential at all."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import urllib.request
import uuid

import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER
from airflow_provider_batchinfer.contract.specs import JobSpec, OutputSpec
from airflow_provider_batchinfer.store.stage import Stage
from tests.conftest import _free_port
from tests.task_context import TaskInstanceStandIn

pytestmark = [pytest.mark.usefixtures("airflow_db")]

SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
#: names that only a credential's value would sit under
CREDENTIAL_NAMES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "secret_key", "session_token")


@pytest.fixture
def keyed(ray_cluster, s3_server, s3_bucket, batchinfer_home, monkeypatch):
    """A ``ray_jobs`` connection with permanent-looking keys, its stage and registry on the S3 server;
    the model and 200 tickets (one of them ``boom`` when a test wants a failure) in place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import TextLength

    secret = f"conn-secret-{uuid.uuid4().hex}"
    key_id = f"AKIDCONN{uuid.uuid4().hex[:12].upper()}"
    extra = {
        "launcher": "ray_jobs",
        "python": sys.executable,
        "ray_token": ray_cluster["token"],
        "endpoint_url": s3_server,
        "region_name": "us-east-1",
        "s3_max_attempts": 2,
        "stage_root": f"s3://{s3_bucket}/stage",
        "registry_root": f"s3://{s3_bucket}/registry",
    }
    conn = {"conn_type": "batchinfer", "host": ray_cluster["dashboard"], "login": key_id, "password": secret}
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps({**conn, "extra": extra}))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    options = {"endpoint_url": s3_server, "region": "us-east-1", "access_key": key_id, "secret_key": secret}
    ModelRegistry(f"s3://{s3_bucket}/registry", options).log_model(
        "text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE
    )

    def tickets(name: str, bad_row: int | None = None) -> str:
        texts = [f"ticket {i}" for i in range(200)]
        if bad_row is not None:
            texts[bad_row] = "boom"
        sink = io.BytesIO()
        pq.write_table(pa.table({"ticket_id": pa.array(range(200), pa.int64()), "text": texts}), sink)
        Stage.open(f"s3://{s3_bucket}/{name}/tickets.parquet", options).write_bytes(sink.getvalue())
        return f"s3://{s3_bucket}/{name}"

    return {
        "secret": secret,
        "key_id": key_id,
        "bucket": s3_bucket,
        "options": options,
        "tickets": tickets,
        "cluster": ray_cluster,
    }


def _operator(inputs: str, out: str, **kwargs):
    from airflow_provider_batchinfer import BatchInferenceOperator

    return BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=inputs,
        output_spec=OutputSpec(stage_location=out),
        job_spec=JobSpec(max_batch_rows=50),
        poll_interval=0.5,
        job_timeout=1800,
        **kwargs,
    )


def _jobs_listing(cluster) -> str:
    """``GET /api/jobs/``: what every client holding the cluster's token reads."""
    request = urllib.request.Request(
        f"{cluster['dashboard']}/api/jobs/", headers={"Authorization": f"Bearer {cluster['token']}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


def _assert_no_credential(text: str, keyed: dict, where: str) -> None:
    assert keyed["secret"] not in text, f"the connection's secret key is in {where}"
    for name in CREDENTIAL_NAMES:
        assert name not in text, f"{name} is in {where}"


def test_a_failing_job_reports_its_error_and_no_client_or_log_line_holds_a_credential(keyed, caplog, capfd):
    """One job with keys on the connection, failing on a row: its error reaches the task, nothing
    commits, and neither the Jobs API's listing, the job's metadata, ``_job.json``, the error nor the
    task log holds a credential. What only a committed job writes (``_SUCCESS``, XCom) is checked on
    the role's job below, which commits."""
    from airflow.sdk.exceptions import AirflowException

    caplog.set_level(logging.DEBUG)
    out = f"s3://{keyed['bucket']}/out/fails"
    ti = TaskInstanceStandIn(run_id=f"manual__secrets_fail_{uuid.uuid4().hex[:8]}")

    with pytest.raises(AirflowException, match="ended FAILED: ValueError: cannot score text 'boom'") as info:
        _operator(keyed["tickets"]("input-bad", bad_row=42), out).execute({"ti": ti})

    run_dir = Stage.open(out, keyed["options"])
    assert not run_dir.child(SUCCESS_MARKER).exists()
    claim = json.loads(run_dir.child(JOB_SPEC_FILE).read_bytes())
    listing = _jobs_listing(keyed["cluster"])
    ours = [job for job in json.loads(listing) if job.get("submission_id") == claim["submission_id"]]
    assert len(ours) == 1 and ours[0]["status"] == "FAILED"
    # what the listing shows instead: the secrets package by its content-hash URI and random name
    runtime_env = ours[0]["runtime_env"]
    assert [m[:15] for m in runtime_env["py_modules"]] == ["gcs://_ray_pkg_"]
    assert runtime_env["env_vars"]["BATCHINFER_SECRETS_MODULE"].startswith("batchinfer_secrets_")
    _assert_no_credential(listing, keyed, "GET /api/jobs/")
    _assert_no_credential(json.dumps(ours[0].get("metadata")), keyed, "the job's metadata")
    _assert_no_credential(json.dumps(claim), keyed, "_job.json")
    _assert_no_credential(str(info.value), keyed, "the error message")
    logged = caplog.text + "".join(capfd.readouterr())
    assert "S3 for the Ray job: a session derived through STS, valid until" in logged
    _assert_no_credential(logged, keyed, "the task log")


def test_without_sts_the_job_is_not_started_and_the_key_stays_home(keyed, monkeypatch, caplog, capfd):
    """A store without STS: a clear refusal before anything is written or submitted, never the key."""
    from airflow.sdk.exceptions import AirflowFailException

    conn = json.loads(os.environ["AIRFLOW_CONN_BATCHINFER_DEFAULT"])
    nowhere = f"http://127.0.0.1:{_free_port()}"
    conn["extra"]["sts_endpoint_url"] = nowhere
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps(conn))
    caplog.set_level(logging.DEBUG)
    out = f"s3://{keyed['bucket']}/out/no-sts"
    ti = TaskInstanceStandIn(run_id=f"manual__secrets_nosts_{uuid.uuid4().hex[:8]}")

    with pytest.raises(
        AirflowFailException, match=rf"no job session could be derived through STS at {nowhere}"
    ) as info:
        _operator(keyed["tickets"]("input-nosts"), out).execute({"ti": ti})

    message = str(info.value)
    assert "credentials: worker" in message and "docs/credentials.md" in message
    _assert_no_credential(message, keyed, "the error message")
    _assert_no_credential(caplog.text + "".join(capfd.readouterr()), keyed, "the task log")
    assert not Stage.open(out, keyed["options"]).child(JOB_SPEC_FILE).exists()
    jobs = json.loads(_jobs_listing(keyed["cluster"]))
    assert not [job for job in jobs if (job.get("metadata") or {}).get("run_id") == ti.run_id]


def test_a_local_job_with_keys_on_the_connection_runs_without_sts(
    ray_cluster, text_length_model, tmp_path, monkeypatch, caplog, capfd
):
    """Keys on a ``ray_jobs`` connection and an STS nobody listens at; the job's stage, registry and
    input are local, so it needs no S3 credential: no session is asked for, it commits, and neither
    its key nor any secrets package reaches the cluster."""
    from tests.models import write_tickets

    secret = f"conn-secret-{uuid.uuid4().hex}"
    nowhere = f"http://127.0.0.1:{_free_port()}"
    extra = {
        "launcher": "ray_jobs",
        "python": sys.executable,
        "ray_token": ray_cluster["token"],
        "region_name": "us-east-1",
        "sts_endpoint_url": nowhere,
    }
    conn = {"conn_type": "batchinfer", "host": ray_cluster["dashboard"], "login": "AKIDLOCALJOB", "password": secret}
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps({**conn, "extra": extra}))
    caplog.set_level(logging.INFO)
    inputs = write_tickets(tmp_path / "input", rows=60, files=1)
    out = str(tmp_path / "out" / "run1")
    ti = TaskInstanceStandIn(run_id=f"manual__secrets_local_{uuid.uuid4().hex[:8]}")

    xcom = _operator(str(inputs), out).execute({"ti": ti})

    assert xcom["rows"] == 60 and Stage.open(out).child(SUCCESS_MARKER).exists()
    logged = caplog.text + "".join(capfd.readouterr())
    assert "no session is derived through STS and no key is shipped" in logged
    assert secret not in logged
    claim = json.loads(Stage.open(out).child(JOB_SPEC_FILE).read_bytes())
    (ours,) = [job for job in json.loads(_jobs_listing(ray_cluster)) if job["submission_id"] == claim["submission_id"]]
    assert "py_modules" not in (ours["runtime_env"] or {})  # nothing secret to deliver
    listed = json.dumps(ours)
    assert secret not in listed and "AKIDLOCALJOB" not in listed


# --- a role: only its session may use S3, and the runtime must not assume it again --------------------


def test_a_role_on_the_connection_gives_the_job_that_roles_session_only(
    iam_s3,
    ray_cluster,
    batchinfer_home,
    monkeypatch,
    caplog,
    capfd,
):
    """The user's own keys may only assume the role (the store refuses them S3), and the role may not
    assume itself: the job commits only if it got the role's session and did not assume it again.
    A committed job: what it leaves (``_job.json``, ``_SUCCESS``, XCom, its listing) holds no secret."""
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import TextLength

    endpoint, bucket, key_id, secret, role = iam_s3
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    extra = {
        "launcher": "ray_jobs",
        "python": sys.executable,
        "ray_token": ray_cluster["token"],
        "endpoint_url": endpoint,
        "region_name": "us-east-1",
        "role_arn": role,
        "stage_root": f"s3://{bucket}/jobs-stage",
        "registry_root": f"s3://{bucket}/jobs-registry",
    }
    conn = {"conn_type": "batchinfer", "host": ray_cluster["dashboard"], "login": key_id, "password": secret}
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps({**conn, "extra": extra}))
    via_role = {"endpoint_url": endpoint, "region": "us-east-1", "access_key": key_id, "secret_key": secret}
    via_role["role_arn"] = role
    ModelRegistry(f"s3://{bucket}/jobs-registry", via_role).log_model(
        "text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.table({"ticket_id": pa.array(range(120), pa.int64()), "text": ["t"] * 120}), sink)
    Stage.open(f"s3://{bucket}/jobs-input/tickets.parquet", via_role).write_bytes(sink.getvalue())
    caplog.set_level(logging.INFO)
    out = f"s3://{bucket}/jobs-out/run1"

    xcom = _operator(f"s3://{bucket}/jobs-input", out).execute({"ti": TaskInstanceStandIn(run_id="manual__role")})

    assert xcom["rows"] == 120
    run_dir = Stage.open(out, via_role)
    manifest = run_dir.child(SUCCESS_MARKER).read_bytes().decode()
    claim = json.loads(run_dir.child(JOB_SPEC_FILE).read_bytes())
    logged = caplog.text + "".join(capfd.readouterr())
    assert f"a session derived through STS for role {role}" in logged
    listing = _jobs_listing(ray_cluster)
    ours = [job for job in json.loads(listing) if job.get("submission_id") == claim["submission_id"]]
    assert len(ours) == 1 and ours[0]["status"] == "SUCCEEDED"
    holder = {"secret": secret}
    _assert_no_credential(listing, holder, "GET /api/jobs/")
    _assert_no_credential(json.dumps(ours[0].get("metadata")), holder, "the job's metadata")
    _assert_no_credential(json.dumps(claim), holder, "_job.json")
    _assert_no_credential(manifest, holder, "_SUCCESS")
    _assert_no_credential(json.dumps(xcom, default=str), holder, "XCom")
    _assert_no_credential(logged, holder, "the task log")


# --- the pieces, without a cluster ------------------------------------------------------------------------


def test_a_jobs_environment_holds_a_derived_session_never_the_connections_keys(s3_server, monkeypatch):
    from datetime import datetime, timedelta, timezone

    from airflow_provider_batchinfer.launchers.job_env import job_env
    from airflow_provider_batchinfer.launchers.job_session import JobSessionError, session_seconds

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    keys = {"endpoint_url": s3_server, "region": "us-east-1", "access_key": "AKIDCONN", "secret_key": "conn-secret-x"}
    catalog = {"PYICEBERG_CATALOG__LAKE__TOKEN": "catalog-token-x"}
    env = job_env(keys, catalog, job_timeout=3600)
    assert env.public == {"AWS_ENDPOINT_URL": s3_server, "AWS_DEFAULT_REGION": "us-east-1"}
    assert set(env.secret) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", *catalog}
    assert env.secret["AWS_SECRET_ACCESS_KEY"] != "conn-secret-x" and env.secret["AWS_ACCESS_KEY_ID"] != "AKIDCONN"
    assert env.expires is not None
    left = env.expires - datetime.now(timezone.utc)
    assert timedelta(seconds=3600) < left <= timedelta(seconds=3900 + 60)
    runtime_env = env.runtime_env({"pip": ["x"], "env_vars": {"A": "1"}}, "/tmp/p/batchinfer_secrets_" + "0" * 32)
    assert runtime_env["py_modules"] == ["/tmp/p/batchinfer_secrets_" + "0" * 32] and runtime_env["pip"] == ["x"]
    assert runtime_env["env_vars"]["BATCHINFER_SECRETS_MODULE"] == "batchinfer_secrets_" + "0" * 32
    for value in (*env.secret.values(), "conn-secret-x"):
        assert value not in json.dumps(runtime_env)

    role = "arn:aws:iam::123456789012:role/batch"
    with_role = job_env({**keys, "role_arn": role, "role_session_name": "nightly"}, {}, job_timeout=None)
    assert with_role.public["BATCHINFER_S3_ASSUMED_ROLE"] == role
    assert "BATCHINFER_S3_ROLE_ARN" not in with_role.public  # the runtime does not assume it again
    assert with_role.secret["AWS_SECRET_ACCESS_KEY"] != "conn-secret-x"

    # no keys, or credentials: worker: nothing secret to deliver, no session
    assert job_env({**keys, "credentials": "worker"}, {}, 60).secret == {}
    assert job_env({"endpoint_url": s3_server}, {}, 60).expires is None
    assert session_seconds(60, role=False) == 900 and session_seconds(None, role=True) == 3600
    with pytest.raises(JobSessionError, match=r"job_timeout=50000s \(\+300s margin\) is longer than STS gives an "):
        session_seconds(50000, role=True)


def test_ray_init_passes_no_credential_and_repeats_no_variable_of_the_jobs_runtime_env(monkeypatch):
    from airflow_provider_batchinfer.runtime.attach import worker_runtime_env

    environ = {
        "AWS_ACCESS_KEY_ID": "ASIASESSION",
        "AWS_SECRET_ACCESS_KEY": "session-secret-x",
        "AWS_SESSION_TOKEN": "session-token-x",
        "AWS_ENDPOINT_URL": "http://store:9000",
        "AWS_DEFAULT_REGION": "us-east-1",
        "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"env_vars": {"AWS_ENDPOINT_URL": "x"}}}),
    }
    runtime_env = worker_runtime_env(environ)
    assert runtime_env["env_vars"] == {"AWS_DEFAULT_REGION": "us-east-1"}  # the job's own variable is not repeated
    hook = runtime_env.pop("worker_process_setup_hook")
    for value in ("ASIASESSION", "session-secret-x", "session-token-x"):
        assert value not in json.dumps(runtime_env)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    hook()  # what each Ray worker runs first
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "session-secret-x"
    assert os.environ["AWS_SESSION_TOKEN"] == "session-token-x"
    assert worker_runtime_env({"AWS_DEFAULT_REGION": "eu"}) == {"env_vars": {"AWS_DEFAULT_REGION": "eu"}}


def test_the_secrets_package_round_trips_and_a_wrong_name_is_refused(tmp_path, monkeypatch):
    from airflow_provider_batchinfer.store.delivery import DeliveryError, apply_delivered_env, write_package

    path, name = write_package(str(tmp_path), {"AWS_SECRET_ACCESS_KEY": "s-x", "PYICEBERG_CATALOG__C__TOKEN": "t"})
    assert oct(os.stat(path).st_mode & 0o777) == "0o700"
    assert oct(os.stat(os.path.join(path, "env.json")).st_mode & 0o777) == "0o600"
    # Ray names an uploaded package by its files' content: two jobs with the same values must not share one
    (tmp_path / "twin").mkdir()
    twin, _ = write_package(str(tmp_path / "twin"), {"X": "same"})
    again, _ = write_package(str(tmp_path / "twin"), {"X": "same"})
    assert open(os.path.join(twin, "env.json")).read() != open(os.path.join(again, "env.json")).read()
    monkeypatch.syspath_prepend(str(tmp_path))
    environ = {"BATCHINFER_SECRETS_MODULE": name}
    assert apply_delivered_env(environ) == {"AWS_SECRET_ACCESS_KEY": "s-x", "PYICEBERG_CATALOG__C__TOKEN": "t"}
    assert environ["AWS_SECRET_ACCESS_KEY"] == "s-x"
    assert apply_delivered_env({}) == {}
    with pytest.raises(DeliveryError, match="is not a batchinfer secrets package name"):
        apply_delivered_env({"BATCHINFER_SECRETS_MODULE": "os"})
    with pytest.raises(DeliveryError, match="is not on this process's path"):
        apply_delivered_env({"BATCHINFER_SECRETS_MODULE": "batchinfer_secrets_" + "1" * 32})


def test_uris_lose_their_credentials_and_known_secrets_are_scrubbed():
    from airflow_provider_batchinfer.store.redact import redact_uri, scrub, secret_values

    assert redact_uri("https://TOKEN123@catalog:8181/v1") == "https://***@catalog:8181/v1"
    assert redact_uri("postgresql+psycopg2://user:pw-x@db:5432/cat") == "postgresql+psycopg2://user:***@db:5432/cat"
    assert redact_uri("sqlite:////x/c.db?password=pw-x&timeout=5") == "sqlite:////x/c.db?password=***&timeout=5"
    assert (
        redact_uri("https://cat/v1?access_token=t&sig=s&region=eu")
        == "https://cat/v1?access_token=***&sig=***&region=eu"
    )
    assert redact_uri("https://catalog:8181") == "https://catalog:8181"
    values = secret_values(
        {"AWS_SECRET_ACCESS_KEY": "aws-secret-x", "PYICEBERG_CATALOG__C__URI": "pg://u:db-pass-x@h/d", "HOME": "/root"}
    )
    assert set(values) == {"aws-secret-x", "pg://u:db-pass-x@h/d", "db-pass-x"}
    assert scrub("auth failed for aws-secret-x at pg://u:db-pass-x@h/d (db-pass-x)", values) == (
        "auth failed for *** at *** (***)"
    )


# --- Iceberg catalog properties ----------------------------------------------------------------------------

CATALOG_SECRETS = {
    "header.Authorization": "Bearer hdr-token-9f3a",
    "adls.account-key": "adls-key-9f3a",
    "adls.connection-string": "AccountName=a;AccountKey=conn-key-9f3a",
    "credential": "client:cred-9f3a",
    "x-something-new": "new-secret-9f3a",
}


def _catalog_props(uri: str) -> dict[str, str]:
    return {"name": "lake", "type": "rest", "uri": uri, "warehouse": "s3://lake/wh", **CATALOG_SECRETS}


def test_only_allowed_catalog_properties_reach_job_files_and_manifests(tmp_path):
    from airflow_provider_batchinfer.contract import JobFile, Manifest
    from airflow_provider_batchinfer.contract.tables import TableInput, TableOutput
    from airflow_provider_batchinfer.store.iceberg.catalog import (
        catalog_env_properties,
        catalog_secret_env,
        public_catalog,
    )
    from tests.runs import job_file, manifest_for

    for uri, secret in (
        ("https://tok-9f3a@catalog:8181", "tok-9f3a"),
        ("https://catalog:8181/v1?password=pw-9f3a&x=1", "pw-9f3a"),
        ("postgresql://u:pw2-9f3a@db/x", "pw2-9f3a"),
    ):
        props = _catalog_props(uri)
        public = public_catalog(props)
        assert set(public) == {"name", "type", "uri", "warehouse"} and "***" in public["uri"]
        target = TableOutput("ml.scores", public, "run1", "overwrite", "/claims/run1", "/wh/t")
        job = JobFile.from_dict({**job_file(tmp_path).to_dict(), "table_output": target.to_dict()})
        manifest = Manifest.from_dict(
            {
                **manifest_for(tmp_path, ()).to_dict(),
                "table": target.with_snapshot(9).to_dict(),
                "table_input": TableInput("raw.t", public, 4).to_dict(),
            }
        )
        written = json.dumps(job.to_dict()) + json.dumps(manifest.to_dict())
        for value in (secret, *CATALOG_SECRETS.values()):
            assert value not in written
        # everything left out reaches the runtime through its environment, and reads back whole
        env = catalog_secret_env(props)
        assert all(name.startswith("PYICEBERG_CATALOG__LAKE__") for name in env)
        back = catalog_env_properties("lake", env)
        assert back == {"uri": uri, **{k.lower(): v for k, v in CATALOG_SECRETS.items()}}


def test_open_catalog_takes_what_the_environment_delivers_and_its_errors_hold_no_secret(tmp_path, monkeypatch):
    from airflow_provider_batchinfer.store.iceberg.catalog import (
        CatalogError,
        catalog_secret_env,
        open_catalog,
        public_catalog,
    )

    props = {
        "name": "lake",
        "type": "sql",
        "uri": f"sqlite:///{tmp_path}/cat/catalog.db?password=pw-9f3a",
        "warehouse": f"file://{tmp_path}/wh",
        "header.Authorization": "Bearer hdr-token-9f3a",
    }
    for name, value in catalog_secret_env(props).items():
        monkeypatch.setenv(name, value)
    catalog = open_catalog(public_catalog(props))  # what the runtime has: the job file's view + its environment
    assert catalog.properties["uri"] == props["uri"]
    assert catalog.properties["header.authorization"] == "Bearer hdr-token-9f3a"

    with pytest.raises(CatalogError) as info:
        open_catalog({"name": "bad", "type": "sql", "uri": "nosuchdialect://u:pw-bad-9f3a@h/db?token=tk-9f3a"})
    assert "nosuchdialect://u:***@h/db?token=***" in str(info.value)
    assert "pw-bad-9f3a" not in str(info.value) and "tk-9f3a" not in str(info.value)


def test_an_iceberg_run_writes_no_catalog_secret_into_any_file(tmp_path, monkeypatch, caplog, capfd):
    """One run into a table of a catalog whose properties hold an ``Authorization`` header and a
    password in its URI: it commits (the runtime got them through its environment), and no file
    the run wrote, no XCom, lineage facet or log line holds either."""
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.iceberg_support import operator
    from tests.models import TextLength, write_tickets

    password, token = f"pw-{uuid.uuid4().hex}", f"hdr-{uuid.uuid4().hex}"
    root = tmp_path / "world"
    catalog = {
        "name": "lake",
        "type": "sql",
        "uri": f"sqlite:///{root}/catalog/catalog.db?password={password}",
        "warehouse": f"file://{root}/warehouse",
        "header.Authorization": f"Bearer {token}",
    }
    extra = {"stage_root": str(root / "stage"), "registry_root": str(root / "registry"), "iceberg_catalog": catalog}
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps({"conn_type": "batchinfer", "extra": extra}))
    monkeypatch.setenv("BATCHINFER_HOME", str(root / "home"))
    ModelRegistry(str(root / "registry")).log_model(
        "text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE
    )
    inputs = write_tickets(root / "input", rows=120, files=2)
    caplog.set_level(logging.DEBUG)
    ti = TaskInstanceStandIn(dag_id="bi_iceberg_secrets", run_id="run1")

    op = operator("ml.scores", inputs)
    xcom = op.execute({"ti": ti})

    assert xcom["rows"] == 120 and xcom["output_location"] == "iceberg://ml.scores/run1"
    lineage = op.get_openlineage_facets_on_complete(ti)
    texts = [json.dumps(xcom, default=str), repr(lineage), caplog.text, "".join(capfd.readouterr())]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {"_manifest.json", "_job.json", "catalog.db"} <= {p.name for p in files}
    assert any(p.name.endswith(".metadata.json") for p in files)  # the snapshot summary's home
    for text, where in [*((t, "XCom, lineage or logs") for t in texts), *((p.read_bytes(), str(p)) for p in files)]:
        for secret in (password, token):
            assert (secret.encode() if isinstance(text, bytes) else secret) not in text, f"{secret} in {where}"
