"""Long jobs and S3 credentials: temporary keys are never frozen into a job that outlives
them. Either every process assumes the connection's ``role_arn`` itself (and refreshes it), or the
workers use their own chain (``credentials: worker``), or the task refuses to start the job.

The role path runs for real: a ``moto_server`` on 127.0.0.1 with IAM auth enforced, where the
connection's own keys may do nothing but ``sts:AssumeRole`` and only the role may use S3, so a job
that commits can only have read and written through the role, in the task, the Ray driver and every
Ray worker (pyarrow's STS provider, pointed at moto by ``AWS_ENDPOINT_URL_STS``).
"""

from __future__ import annotations

import io
import json
import pickle
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from airflow.sdk import Connection

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec, SaveMode
from airflow_provider_batchinfer.hooks.s3_credentials import (
    LIFETIME_MARGIN_S,
    credential_lifetime_problem,
    expiry_of,
    parse_expiration,
    role_options,
)
from airflow_provider_batchinfer.hooks.service_config import ServiceConfig
from airflow_provider_batchinfer.store.s3 import (
    S3StageError,
    check_bucket,
    credential_env,
    public_options,
    role_settings,
    worker_env,
)
from airflow_provider_batchinfer.store.stage import Stage
from tests.conftest import _free_port
from tests.task_context import TaskInstanceStandIn

from airflow.sdk.exceptions import AirflowFailException  # isort: skip

ROLE = "arn:aws:iam::123456789012:role/batch-inference"
NOW = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)
TEMP = {"access_key": "ASIATEMP", "secret_key": "temp-secret", "session_token": "tok-123"}
SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}


def _conn(login: str | None = None, password: str | None = None, **extra: object) -> Connection:
    return Connection(conn_id="c", conn_type="batchinfer", login=login, password=password, extra=json.dumps(extra))


# --- parsing and validation (no servers) -------------------------------------------------------------


def test_role_extras_are_parsed_into_public_storage_options():
    conn = _conn(
        "AKIDPERM",
        "perm-secret",
        role_arn=ROLE,
        role_session_name="nightly-scoring",
        external_id="ext-42",
        sts_endpoint_url="https://sts.eu-west-1.amazonaws.com",
        endpoint_url="http://minio:9000",
    )
    cfg = ServiceConfig.from_connection(conn, "c")
    assert cfg.storage_options["role_arn"] == ROLE
    # the role settings are not secret: they travel in the job file, so every process assumes the role
    assert cfg.s3 == {
        "endpoint_url": "http://minio:9000",
        "role_arn": ROLE,
        "role_session_name": "nightly-scoring",
        "external_id": "ext-42",
        "sts_endpoint_url": "https://sts.eu-west-1.amazonaws.com",
    }
    assert "perm-secret" not in json.dumps(cfg.to_dict())
    env = credential_env(dict(cfg.storage_options))
    assert env["AWS_ENDPOINT_URL_STS"] == "https://sts.eu-west-1.amazonaws.com"
    assert env["AWS_ACCESS_KEY_ID"] == "AKIDPERM"  # permanent base keys: the role is assumed from them
    # the runtime reads its job file before it has the job's options: the role reaches it by environment
    assert (env["BATCHINFER_S3_ROLE_ARN"], env["BATCHINFER_S3_ROLE_SESSION_NAME"]) == (ROLE, "nightly-scoring")
    assert env["BATCHINFER_S3_EXTERNAL_ID"] == "ext-42"
    assert {"BATCHINFER_S3_ROLE_ARN", "AWS_ENDPOINT_URL_STS"} <= set(worker_env(env))  # and on to the workers


def test_the_role_comes_from_the_options_else_the_environment(monkeypatch):
    monkeypatch.delenv("BATCHINFER_S3_ROLE_ARN", raising=False)
    assert role_settings({}) == {}
    monkeypatch.setenv("BATCHINFER_S3_ROLE_ARN", ROLE)
    monkeypatch.setenv("BATCHINFER_S3_ROLE_SESSION_NAME", "from-env")
    assert role_settings({}) == {"role_arn": ROLE, "role_session_name": "from-env"}
    other = "arn:aws:iam::123456789012:role/other"
    assert role_settings({"role_arn": other}) == {"role_arn": other}  # the job's own options win


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"role_arn": "batch-inference"}, r"role_arn 'batch-inference' is not an IAM role ARN such as arn:aws:iam::"),
        ({"role_arn": "arn:aws:iam::12345:role/x"}, r"role_arn 'arn:aws:iam::12345:role/x' is not an IAM role ARN"),
        ({"role_arn": "arn:aws:iam::123456789012:user/bob"}, r"role_arn 'arn:aws:iam::123456789012:user/bob' is not"),
        ({"role_session_name": "x1"}, "role_session_name is set but role_arn is empty"),
        ({"role_arn": ROLE, "role_session_name": "has space"}, r"role_session_name 'has space' must be 2 to 64"),
        ({"role_arn": ROLE, "external_id": "x"}, r"external_id 'x' must be 2 to 1224"),
        ({"credentials": "instance"}, r"credentials 'instance' is not one of \('connection', 'worker'\)"),
    ],
)
def test_bad_role_settings_say_what_is_wrong(extra, message):
    with pytest.raises(ValueError, match=rf"connection 'c': {message}"):
        role_options(extra, "c")
    with pytest.raises(ValueError, match=message):  # and so does parsing the whole connection
        ServiceConfig.from_connection(_conn(**extra), "c")


def test_role_arn_partitions_and_paths_are_accepted():
    for arn in (ROLE, "arn:aws-cn:iam::123456789012:role/team/batch", "arn:aws-us-gov:iam::123456789012:role/a.b@c"):
        assert role_options({"role_arn": arn}, "c") == {"role_arn": arn}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2026-11-23T14:30:00Z", datetime(2026, 11, 23, 14, 30, tzinfo=timezone.utc)),
        ("2026-11-23T15:30:00+01:00", datetime(2026, 11, 23, 14, 30, tzinfo=timezone.utc)),
        ("", None),
        (None, None),
    ],
)
def test_session_expiration_parses_iso_8601_with_a_timezone(value, expected):
    assert parse_expiration(value, "c") == expected


@pytest.mark.parametrize("value", ["tomorrow", "2026-11-23T14:30:00", "1700000000", "2026-13-01T00:00:00Z"])
def test_a_bad_session_expiration_is_named(value):
    with pytest.raises(
        ValueError,
        match=rf"connection 'c': aws_session_expiration '{value}' is not an ISO 8601 time with a timezone "
        r"such as 2026-11-23T14:30:00Z",
    ):
        ServiceConfig.from_connection(_conn("ASIA", "s", aws_session_token="t", aws_session_expiration=value), "c")


def test_the_expiry_comes_from_the_connection_or_its_aws_connection():
    cfg = ServiceConfig.from_connection(
        _conn("ASIA", "s", aws_session_token="t", aws_session_expiration="2026-11-23T14:30:00Z"), "c"
    )
    assert cfg.credential_expiry == datetime(2026, 11, 23, 14, 30, tzinfo=timezone.utc)
    assert "expiration" not in cfg.storage_options  # never reaches a filesystem or a job file
    aws = Connection(
        conn_id="aws",
        conn_type="aws",
        login="ASIAAWS",
        password="aws-secret",
        extra=json.dumps({"aws_session_token": "aws-tok", "aws_session_expiration": "2026-11-23T13:00:00Z"}),
    )
    via_aws = ServiceConfig.from_connection(_conn(aws_conn_id="aws"), "c", get_connection={"aws": aws}.__getitem__)
    assert via_aws.storage_options["session_token"] == "aws-tok"
    assert via_aws.credential_expiry == datetime(2026, 11, 23, 13, 0, tzinfo=timezone.utc)
    # keys are one set: the batchinfer connection's own keys never pick up the aws connection's token
    own = ServiceConfig.from_connection(
        _conn("AKIDPERM", "p", aws_conn_id="aws"), "c", get_connection={"aws": aws}.__getitem__
    )
    assert "session_token" not in own.storage_options and own.credential_expiry is None


def test_refreshable_botocore_credentials_know_their_expiry():
    from botocore.credentials import Credentials, RefreshableCredentials

    expiry = datetime.now(timezone.utc) + timedelta(hours=1)
    refreshable = RefreshableCredentials.create_from_metadata(
        {"access_key": "A", "secret_key": "S", "token": "T", "expiry_time": expiry.isoformat()},
        refresh_using=lambda: {},
        method="assume-role",
    )
    assert expiry_of(refreshable) == expiry.replace(microsecond=expiry.microsecond)
    assert expiry_of(Credentials("A", "S")) is None


def test_credentials_worker_ships_no_keys():
    from airflow_provider_batchinfer.launchers.local import LocalLauncher
    from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher

    cfg = ServiceConfig.from_connection(
        Connection(
            conn_id="c",
            conn_type="batchinfer",
            host="http://ray-head:8265",
            login="ASIATEMP",
            password="temp-secret",
            extra=json.dumps(
                {"aws_session_token": "tok-123", "credentials": "worker", "endpoint_url": "http://minio:9000"}
            ),
        ),
        "c",
    )
    assert cfg.storage_options["secret_key"] == "temp-secret"  # the task itself still uses them
    assert credential_env(dict(cfg.storage_options)) == {"AWS_ENDPOINT_URL": "http://minio:9000"}
    assert LocalLauncher.from_config(cfg).extra_env == {"AWS_ENDPOINT_URL": "http://minio:9000"}
    shipped = json.dumps(RayJobsLauncher.from_config(cfg).runtime_env)
    for secret in ("ASIATEMP", "temp-secret", "tok-123"):
        assert secret not in shipped
    assert public_options(dict(cfg.storage_options))["credentials"] == "worker"
    # nothing temporary is shipped, so nothing can expire mid-job
    assert credential_lifetime_problem(dict(cfg.storage_options), None, 36000, NOW, "c") is None


def test_permanent_keys_pass_and_temporary_ones_must_outlive_the_deadline():
    assert credential_lifetime_problem({"access_key": "AKID", "secret_key": "s"}, None, None, NOW, "c") is None
    assert credential_lifetime_problem({}, None, 3600, NOW, "c") is None  # the default chain refreshes itself
    later = NOW + timedelta(seconds=3600 + LIFETIME_MARGIN_S + 1)
    assert credential_lifetime_problem(TEMP, later, 3600, NOW, "c") is None

    soon = NOW + timedelta(minutes=50)
    problem = credential_lifetime_problem(TEMP, soon, 3600, NOW, "c")
    assert problem is not None
    assert "connection 'c': the job was not started: its S3 credentials are temporary (a session token)" in problem
    assert "expire at 2026-11-23T12:50:00+00:00, 3000s from now, before the job's deadline" in problem
    assert "(job_timeout=3600s + 300s margin)" in problem
    assert "set the connection extra role_arn" in problem and "credentials: worker" in problem
    assert problem.endswith("or a job_timeout under 2700s")

    unknown = credential_lifetime_problem(TEMP, None, 3600, NOW, "c")
    assert unknown is not None
    assert "with no known expiry, so a job of up to job_timeout=3600s cannot be shown to finish" in unknown
    assert "set the extra aws_session_expiration to its expiry" in unknown

    no_timeout = credential_lifetime_problem(TEMP, later, None, NOW, "c")
    assert no_timeout is not None and "the task has no job_timeout, so the job may outlast them" in no_timeout

    expired = credential_lifetime_problem(TEMP, NOW - timedelta(minutes=1), 60, NOW, "c")
    assert expired is not None and "0s from now" in expired and expired.endswith("or fresh credentials")

    # a role refreshed with the same temporary keys cannot outlive them either
    with_role = credential_lifetime_problem({**TEMP, "role_arn": ROLE}, None, 3600, NOW, "c")
    assert with_role is not None and "role_arn is set, but the role is refreshed with these same temporary keys" in (
        with_role
    )


def test_a_role_filesystem_pickles_with_the_role_and_no_secret(monkeypatch):
    """What Ray ships to every read and write task: the role, so each task assumes it itself.
    The AWS SDK asks STS for the role's session as the filesystem is built: here it asks a closed
    port on this machine, once, instead of AWS's STS with the SDK's retries and backoff."""
    from airflow_provider_batchinfer.store.s3 import filesystem

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    fs = filesystem({"endpoint_url": "http://127.0.0.1:1", "region": "us-east-1", "role_arn": ROLE})
    (kwargs,) = fs.__reduce__()[1]
    assert (kwargs["role_arn"], kwargs["session_name"], kwargs["load_frequency"]) == (ROLE, "batchinfer", 900)
    assert (kwargs["access_key"], kwargs["secret_key"], kwargs["session_token"]) == (None, None, None)
    assert pickle.loads(pickle.dumps(fs)).__reduce__()[1][0]["role_arn"] == ROLE


# --- against a real S3 server --------------------------------------------------------------------------


def _s3_connection(monkeypatch, endpoint: str, bucket: str, login: str, password: str, **extra: object) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCHINFER_DEFAULT",
        json.dumps(
            {
                "conn_type": "batchinfer",
                "login": login,
                "password": password,
                "extra": {
                    "endpoint_url": endpoint,
                    "region_name": "us-east-1",
                    "s3_max_attempts": 2,
                    "stage_root": f"s3://{bucket}/stage",
                    "registry_root": f"s3://{bucket}/registry",
                    **extra,
                },
            }
        ),
    )
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)


def _operator(inputs: str, out: str, job_timeout: float | None):
    from airflow_provider_batchinfer import BatchInferenceOperator

    return BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=inputs,
        input_spec=InputSpec(id_column="ticket_id"),
        output_spec=OutputSpec(stage_location=out, mode=SaveMode.ERROR),
        job_spec=JobSpec(max_batch_rows=50, progress_interval_s=1),
        job_timeout=job_timeout,
    )


def _put_tickets(location: str, options: dict, rows: int = 200) -> str:
    table = pa.table({"ticket_id": pa.array(range(rows), pa.int64()), "text": [f"ticket {i}" for i in range(rows)]})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    Stage.open(f"{location}/tickets.parquet", options).write_bytes(sink.getvalue())
    return location


def _log_model(registry_root: str, options: dict):
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import TextLength

    return ModelRegistry(registry_root, options).log_model(
        "text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE
    )


def _objects(endpoint: str, bucket: str, prefix: str) -> list[str]:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="AKIDTEST", aws_secret_access_key="x"
    )
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


@pytest.mark.usefixtures("airflow_db")
def test_a_session_token_of_unknown_expiry_is_refused_before_any_work(s3_server, s3_bucket, monkeypatch):
    _s3_connection(monkeypatch, s3_server, s3_bucket, "ASIATEMPKEY", "temp-secret", aws_session_token="tok-123")
    op = _operator(f"s3://{s3_bucket}/input", f"s3://{s3_bucket}/out/run1", job_timeout=4 * 3600)
    with pytest.raises(
        AirflowFailException,
        match=r"connection 'batchinfer_default': the job was not started: its S3 credentials are temporary "
        r"\(a session token\) with no known expiry, so a job of up to job_timeout=14400s cannot be shown to "
        r"finish before they expire\. To fix: set the connection extra role_arn .* credentials: worker",
    ) as info:
        op.execute({"ti": TaskInstanceStandIn()})
    assert "temp-secret" not in str(info.value) and "tok-123" not in str(info.value)
    assert _objects(s3_server, s3_bucket, "out/") == []  # no run directory, no _job.json


@pytest.mark.usefixtures("airflow_db")
def test_a_session_token_that_expires_before_the_deadline_is_refused(s3_server, s3_bucket, monkeypatch):
    soon = (datetime.now(timezone.utc) + timedelta(minutes=30)).isoformat()
    _s3_connection(
        monkeypatch, s3_server, s3_bucket, "ASIA", "temp-secret", aws_session_token="t", aws_session_expiration=soon
    )
    with pytest.raises(AirflowFailException, match=r"before the job's deadline \(job_timeout=7200s \+ 300s margin\)"):
        _operator(f"s3://{s3_bucket}/input", f"s3://{s3_bucket}/out/run1", job_timeout=7200).execute(
            {"ti": TaskInstanceStandIn()}
        )
    assert _objects(s3_server, s3_bucket, "out/") == []


@pytest.mark.usefixtures("airflow_db")
def test_a_session_token_that_outlives_the_deadline_runs_and_commits(s3_server, s3_bucket, monkeypatch):
    later = (datetime.now(timezone.utc) + timedelta(hours=3)).isoformat()
    _s3_connection(
        monkeypatch, s3_server, s3_bucket, "ASIAOK", "temp-secret", aws_session_token="t", aws_session_expiration=later
    )
    options = {"endpoint_url": s3_server, "region": "us-east-1", "access_key": "A", "secret_key": "s"}
    _log_model(f"s3://{s3_bucket}/registry", options)
    inputs = _put_tickets(f"s3://{s3_bucket}/input", options)
    xcom = _operator(inputs, f"s3://{s3_bucket}/out/run1", job_timeout=3600).execute({"ti": TaskInstanceStandIn()})
    assert xcom["rows"] == 200
    assert f"out/run1/{SUCCESS_MARKER}" in _objects(s3_server, s3_bucket, "out/run1/")


# --- the role, assumed for real by every process ---------------------------------------------------------


def test_the_users_own_keys_cannot_use_s3_only_the_role_can(iam_s3, monkeypatch):
    """The premise of the next test, checked: without the role the store refuses the user."""
    endpoint, bucket, key_id, secret, role = iam_s3
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    own = {"endpoint_url": endpoint, "region": "us-east-1", "access_key": key_id, "secret_key": secret}
    with pytest.raises(S3StageError, match="ACCESS_DENIED|AccessDenied"):
        Stage.open(f"s3://{bucket}/probe", {**own, "max_attempts": 1}).write_bytes(b"x")
    Stage.open(f"s3://{bucket}/probe", {**own, "role_arn": role}).write_bytes(b"x")  # assumed with boto3 (task side)
    # the runtime's way: no keys in the options, the role assumed by pyarrow from the process's chain
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", endpoint)
    chain = {"endpoint_url": endpoint, "region": "us-east-1", "role_arn": role, "role_session_name": "probe"}
    assert Stage.open(f"s3://{bucket}/probe", chain).read_bytes() == b"x"
    check_bucket(Stage.open(f"s3://{bucket}/probe", chain).fs, f"s3://{bucket}/probe")
    nowhere = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(
        S3StageError,
        match=rf"could not assume role '{role}' for S3 at {nowhere}: .*Could not connect.*Check role_arn, the "
        "role's trust policy",
    ) as info:
        Stage.open(f"s3://{bucket}/probe", {**own, "role_arn": role, "sts_endpoint_url": nowhere})
    assert info.value.permanent and secret not in str(info.value)


@pytest.mark.usefixtures("airflow_db", "ray_cluster")
def test_a_job_reads_and_writes_s3_through_the_assumed_role(iam_s3, monkeypatch, capfd):
    endpoint, bucket, key_id, secret, role = iam_s3
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    _s3_connection(
        monkeypatch,
        endpoint,
        bucket,
        key_id,
        secret,
        role_arn=role,
        role_session_name="nightly",
        sts_endpoint_url=endpoint,
    )
    via_role = {"endpoint_url": endpoint, "region": "us-east-1", "access_key": key_id, "secret_key": secret}
    via_role["role_arn"] = role
    _log_model(f"s3://{bucket}/registry", via_role)
    inputs = _put_tickets(f"s3://{bucket}/input", via_role, rows=300)
    out = f"s3://{bucket}/out/run1"

    xcom = _operator(inputs, out, job_timeout=3600).execute({"ti": TaskInstanceStandIn()})

    assert xcom["rows"] == 300 and xcom["output_location"] == out
    run_dir = Stage.open(out, via_role)
    manifest = json.loads(run_dir.child(SUCCESS_MARKER).read_bytes())
    assert manifest["counts"] == {"input_rows": 300, "output_rows": 300, "error_rows": 0}
    job_text = run_dir.child(JOB_SPEC_FILE).read_bytes().decode()
    assert json.loads(job_text)["storage_options"] == {
        "max_attempts": 2,
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "role_arn": role,
        "role_session_name": "nightly",
        "sts_endpoint_url": endpoint,
    }
    for text in (job_text, json.dumps(manifest), json.dumps(xcom, default=str), capfd.readouterr().out):
        assert secret not in text and key_id not in text
        for name in ("secret_key", "session_token", "access_key"):
            assert name not in text
