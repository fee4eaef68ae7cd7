"""A SQL input is read by the job, never by the Airflow task process: one ``ray_jobs`` job on the
session's ``ray start`` cluster reads a SQLite query in shards (``ray.data.read_sql``). The task
process opens no connection to the database (an audit hook sees every ``sqlite3.connect`` in it),
the sharded read holds exactly the rows of the driver's unsharded stream, and the connection's
password is in none of what the job lists, logs or writes."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import sys
import urllib.request
import uuid
from contextlib import closing

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec
from tests.task_context import TaskInstanceStandIn

pytestmark = pytest.mark.usefixtures("airflow_db")

ROWS = 600
QUERY = "SELECT id AS ticket_id, body AS text FROM tickets ORDER BY id"
#: every sqlite3.connect of this process while ``_connects["on"]`` (an audit hook cannot be removed)
_connects: dict = {"on": False, "seen": []}


def _audit(event: str, args: tuple) -> None:
    if event == "sqlite3.connect" and _connects["on"]:
        _connects["seen"].append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def sqlite_tickets(tmp_path, monkeypatch):
    """The tickets in SQLite and a SQL connection to them whose URI carries a password."""
    db = tmp_path / "tickets.db"
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("CREATE TABLE tickets (id INTEGER PRIMARY KEY, body TEXT)")
        conn.executemany("INSERT INTO tickets VALUES (?, ?)", [(i, f"ticket number {i}") for i in range(ROWS)])
    password = f"db-pass-{uuid.uuid4().hex}"
    # Airflow writes the extra as the URI's query: sqlite:////…/tickets.db?password=…
    monkeypatch.setenv(
        "AIRFLOW_CONN_BI_SQL_TICKETS",
        json.dumps({"conn_type": "sqlite", "host": str(db), "extra": {"password": password}}),
    )
    return {"db": db, "password": password}


@pytest.fixture
def tickets_db(sqlite_tickets, ray_cluster, batchinfer_home, text_length_model, monkeypatch):
    """The SQLite tickets, the model, and a ``ray_jobs`` connection to the session's cluster."""
    extra = {
        "launcher": "ray_jobs",
        "python": sys.executable,
        "ray_token": ray_cluster["token"],
        "stage_root": str(batchinfer_home / "stage"),
        "registry_root": str(batchinfer_home / "registry"),
    }
    conn = {"conn_type": "batchinfer", "host": ray_cluster["dashboard"], "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps(conn))
    return {**sqlite_tickets, "cluster": ray_cluster}


def _api(cluster: dict, path: str) -> str:
    """A GET on the Jobs API, as any client holding the cluster's token reads it."""
    request = urllib.request.Request(
        f"{cluster['dashboard']}{path}", headers={"Authorization": f"Bearer {cluster['token']}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


def test_the_job_reads_the_query_in_shards_and_no_listing_log_or_file_holds_the_password(
    tickets_db, tmp_path, monkeypatch, caplog, capfd
):
    from airflow_provider_batchinfer import BatchInferenceOperator
    from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV, SqlInput
    from airflow_provider_batchinfer.operators.build_job import database_url
    from airflow_provider_batchinfer.runtime.inputs.sql_input import stream
    from airflow_provider_batchinfer.store.stage import Stage

    caplog.set_level(logging.DEBUG)
    out = tmp_path / "out"
    operator = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        sql=QUERY,
        conn_id="bi_sql_tickets",
        shard_column="ticket_id",
        shard_hash_fn="",  # SQLite has no MD5: MOD(ABS((ticket_id)), n) on the integer id
        input_spec=InputSpec(id_column="ticket_id"),
        output_spec=OutputSpec(stage_location=str(out)),
        job_spec=JobSpec(max_batch_rows=100),
        poll_interval=0.5,
        job_timeout=600,
    )
    _connects["on"], _connects["seen"] = True, []
    try:
        xcom = operator.execute({"ti": TaskInstanceStandIn(run_id=f"manual__sql_{uuid.uuid4().hex[:8]}")})
    finally:
        _connects["on"] = False
    assert _connects["seen"] == [], "the Airflow task process connected to the database"
    assert xcom["rows"] == ROWS
    logged = caplog.text + "".join(capfd.readouterr())
    (read,) = [line for line in logged.splitlines() if "[batchinfer] input:" in line and "query on" in line]
    assert f"{ROWS:,} rows of the query on bi_sql_tickets read in " in read
    assert " shard(s) by ticket_id on Ray (ray.data.read_sql)" in read

    # the sharded read holds exactly the rows of the driver's unsharded stream of the same query
    claim = json.loads((out / JOB_SPEC_FILE).read_text())
    sharded = out / "_input" / claim["attempt"]
    assert len({p.name.split("-")[1] for p in sharded.glob("part-*.parquet")}) >= 2, "not read in shards"
    monkeypatch.setenv(SQL_URL_ENV, database_url("bi_sql_tickets"))
    (tmp_path / "streamed").mkdir()
    _connects["on"] = True  # the hook does see a read in this process: the driver's stream, run here
    try:
        streamed = stream(
            SqlInput(query=QUERY, conn_id="bi_sql_tickets", chunk_rows=250), Stage.open(str(tmp_path / "streamed"))
        )
    finally:
        _connects["on"] = False
    assert streamed == (ROWS, 3) and _connects["seen"] == [str(tickets_db["db"])]
    assert (
        pq.read_table(sharded).sort_by("ticket_id").to_pylist()
        == pq.read_table(tmp_path / "streamed").sort_by("ticket_id").to_pylist()
    )

    # the password: in no listing of the job (entrypoint, runtime_env, metadata), its driver log,
    # _job.json, _SUCCESS, XCom or the task log
    password = tickets_db["password"]
    listing = _api(tickets_db["cluster"], "/api/jobs/")
    (ours,) = [job for job in json.loads(listing) if job.get("submission_id") == claim["submission_id"]]
    assert ours["status"] == "SUCCEEDED" and "--spec" in ours["entrypoint"]
    driver_log = json.loads(_api(tickets_db["cluster"], f"/api/jobs/{claim['submission_id']}/logs"))["logs"]
    assert "rows of the query on bi_sql_tickets read in" in driver_log
    for where, text in {
        "GET /api/jobs/": listing,
        "the driver log": driver_log,
        "_job.json": json.dumps(claim),
        "_SUCCESS": (out / SUCCESS_MARKER).read_text(),
        "XCom": json.dumps(xcom, default=str),
        "the task log": logged,
    }.items():
        assert password not in text, f"the database password is in {where}"
        assert SQL_URL_ENV not in text or where == "the task log", f"{SQL_URL_ENV} is named in {where}"


def test_a_connection_that_is_not_sql_fails_before_any_job(batchinfer_home, tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_batchinfer.operators.build_job import database_url

    monkeypatch.setenv("AIRFLOW_CONN_BI_NOT_SQL", json.dumps({"conn_type": "fs", "extra": {"path": "/tmp"}}))
    with pytest.raises(AirflowFailException, match="connection 'bi_not_sql' is not a SQL connection"):
        database_url("bi_not_sql")


def test_the_database_url_reaches_workers_by_the_setup_hook_and_is_scrubbed(monkeypatch):
    from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV
    from airflow_provider_batchinfer.runtime.attach import worker_runtime_env
    from airflow_provider_batchinfer.store.redact import scrub, secret_values

    url = "postgresql+psycopg2://scorer:pg-pass-77x@db:5432/crm"
    runtime_env = worker_runtime_env({SQL_URL_ENV: url, "AWS_DEFAULT_REGION": "eu"})
    hook = runtime_env.pop("worker_process_setup_hook")
    assert runtime_env == {"env_vars": {"AWS_DEFAULT_REGION": "eu"}}  # the URL is in no listed variable
    monkeypatch.delenv(SQL_URL_ENV, raising=False)
    hook()  # what each Ray worker runs first
    assert os.environ[SQL_URL_ENV] == url
    values = secret_values({SQL_URL_ENV: url, "HOME": "/root"})
    assert set(values) == {url, "pg-pass-77x"}
    assert scrub(f"could not connect to {url}: password pg-pass-77x refused", values) == (
        "could not connect to ***: password *** refused"
    )


def test_the_query_section_round_trips_and_bad_arguments_are_refused(tmp_path):
    from airflow_provider_batchinfer import BatchInferenceOperator
    from airflow_provider_batchinfer.contract import ContractError, JobFile
    from airflow_provider_batchinfer.contract.specs import SpecError
    from airflow_provider_batchinfer.contract.sql_input import SqlInput
    from tests.runs import job_file

    query = SqlInput(query=QUERY, conn_id="crm", chunk_rows=500, shard_column="ticket_id", kept_digest="ab" * 32)
    job = JobFile.from_json(JobFile(**{**vars(job_file(tmp_path)), "sql_input": query}).to_json())
    assert job.sql_input == query and "sql_input" not in job_file(tmp_path).to_dict()
    with pytest.raises(ContractError, match=r"sql_input.shard_column 'id\); DROP TABLE t' must be a plain SQL name"):
        SqlInput(query=QUERY, conn_id="crm", shard_column="id); DROP TABLE t")
    with pytest.raises(ContractError, match="sql_input.chunk_rows must be >= 1, got 0"):
        SqlInput(query=QUERY, conn_id="crm", chunk_rows=0)
    with pytest.raises(SpecError, match="infer: shard_column= shards a sql= input; it has no meaning for input="):
        BatchInferenceOperator(
            task_id="infer",
            model="m",
            version="v1",
            input="/data/in",
            shard_column="id",
            output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
        )


def test_a_database_that_cannot_hash_the_column_is_streamed_by_the_driver(
    sqlite_tickets, tmp_path, monkeypatch, capsys
):
    """SQLite has no MD5: the probe fails before any Ray is attached, and the driver streams the query."""
    import dataclasses

    from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV, SqlInput
    from airflow_provider_batchinfer.operators.build_job import database_url
    from airflow_provider_batchinfer.runtime.inputs.sql_input import read_sql_input
    from tests.runs import job_file

    monkeypatch.setenv(SQL_URL_ENV, database_url("bi_sql_tickets"))
    claim = tmp_path / "claim"
    query = SqlInput(query=QUERY, conn_id="bi_sql_tickets", chunk_rows=400, shard_column="ticket_id")
    job = dataclasses.replace(job_file(claim, inputs=(str(claim / "_input"),)), sql_input=query)
    assert read_sql_input(job, None) == [str(claim / "_input" / job.attempt)]
    out = capsys.readouterr().out
    assert "[batchinfer] input: the database cannot shard the query by MOD(ABS(MD5(ticket_id)), 2) (" in out
    assert "no such function: MD5); the driver streams it instead" in out
    assert f"{ROWS:,} rows of the query on bi_sql_tickets read in the driver process, streamed (2 file(s)," in out
