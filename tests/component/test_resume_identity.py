"""SaveMode.RESUME keeps a part only when everything that decided its rows is unchanged.

A retry after ``data_prep`` rewrote the input in place (same ids, other values), or after the task's
params changed, must score every row anew: the earlier attempt's parts were computed from what is
no longer the task's input. Driven through ``BatchInferenceOperator.execute`` as a task's tries run
it: the first try fails on a bad row after its first part is written, the second is the retry."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec, SaveMode
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.commit.fence import PAUSE_ENV
from airflow_provider_batchinfer.store.identity import RESULT_FIELDS, job_identity, result_differences, result_identity
from airflow_provider_batchinfer.store.stage import Stage
from tests.models import committed_manifest, write_tickets
from tests.task_context import TaskInstanceStandIn

from airflow.sdk.exceptions import AirflowException  # isort: skip

SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
ROWS, BAD_ROW = 200, 150  # two input files of 100 rows; the bad row is in the second


@pytest.fixture
def offset_model(registry):
    from tests.resume_models import OffsetLength

    return registry.log_model("offset_length", "v1", "python", python_class=OffsetLength, signature=SIGNATURE)


def _operator(inputs, out, offset: int, **job):
    """The task: ``inputs`` a Parquet directory, or a SQLite file read with a query."""
    from airflow_provider_batchinfer import BatchInferenceOperator

    source = {"input": str(inputs)}
    if inputs.suffix == ".db":
        source = {"sql": "SELECT ticket_id, text FROM tickets ORDER BY ticket_id", "conn_id": "bi_resume_sqlite"}
    return BatchInferenceOperator(
        task_id="infer",
        model="offset_length",
        version="v1",
        **source,
        materialize_chunk_rows=100,  # two materialized files, as the Parquet input has: a part each
        input_spec=InputSpec(id_column="ticket_id", params={"offset": offset}),
        output_spec=OutputSpec(stage_location=str(out), mode=SaveMode.RESUME),
        job_spec=JobSpec(**{"max_batch_rows": 50, **job}),
    )


def _prepared_input(tmp_path, monkeypatch, query: bool):
    """The tickets as ``data_prep`` leaves them: Parquet files, or a SQLite table."""
    inputs = write_tickets(tmp_path / "in", rows=ROWS, files=2, bad_row=BAD_ROW)
    if not query:
        return inputs
    db = tmp_path / "tickets.db"
    monkeypatch.setenv("AIRFLOW_CONN_BI_RESUME_SQLITE", json.dumps({"conn_type": "sqlite", "host": str(db)}))
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("CREATE TABLE tickets (ticket_id INTEGER PRIMARY KEY, text TEXT)")
        conn.executemany(
            "INSERT INTO tickets VALUES (?, ?)",
            [(r["ticket_id"], r["text"]) for r in pq.read_table(inputs).to_pylist()],
        )
    return db


def _rewrite_texts(inputs) -> None:
    """What a re-run ``data_prep`` leaves: the same files (or table), the same ids, other texts."""
    if inputs.suffix == ".db":
        with closing(sqlite3.connect(inputs)) as conn, conn:
            conn.execute("UPDATE tickets SET text = 'v2 ' || text || ' (re-prepared)' WHERE text != 'boom'")
        return
    for path in sorted(inputs.glob("*.parquet")):
        table = pq.read_table(path)
        texts = [t if t == "boom" else f"v2 {t} (re-prepared)" for t in table["text"].to_pylist()]
        pq.write_table(table.set_column(1, "text", pa.array(texts)), path)


def _texts(inputs) -> dict[int, str]:
    if inputs.suffix == ".db":
        with closing(sqlite3.connect(inputs)) as conn:
            return dict(conn.execute("SELECT ticket_id, text FROM tickets"))
    source = pq.read_table(inputs)
    return dict(zip(source["ticket_id"].to_pylist(), source["text"].to_pylist(), strict=True))


@pytest.mark.parametrize(
    ("change", "field"), [("input", "input"), ("params", "params"), ("query", "input"), ("nothing", None)]
)
def test_a_resume_after_the_input_or_params_changed_scores_every_row_from_the_new_ones(
    offset_model, tmp_path, monkeypatch, capsys, change, field
):
    """The first try fails on a bad row after its first part is written; then ``data_prep`` rewrites
    the input in place (Parquet files or the queried table: same ids, other texts) or the task's
    params change; the retry (dead-lettering the bad row) commits only rows scored from the new ones.
    When nothing that decides the rows changed (the error policy and batch size decide only how), the
    retry keeps the first try's part and scores only the rest."""
    # in the driver, whose parts follow the input's order: the first file's part is written before
    # the bad row in the second (the session's Ray, when an earlier test started it, is not needed)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    inputs = _prepared_input(tmp_path, monkeypatch, query=change == "query")
    out = tmp_path / "out"
    with pytest.raises(AirflowException, match="cannot score text 'boom'"):
        _operator(inputs, out, offset=0).execute({"ti": TaskInstanceStandIn(try_number=1)})
    assert not (out / SUCCESS_MARKER).exists()
    assert [p.name for p in out.glob("part-*.parquet")], "the first try left no part to keep"

    offset = 1000 if change == "params" else 0
    if change in ("input", "query"):
        _rewrite_texts(inputs)
    retry = _operator(inputs, out, offset=offset, on_error="dead_letter", max_error_fraction=0.05, max_batch_rows=25)
    capsys.readouterr()
    retry.execute({"ti": TaskInstanceStandIn(try_number=2)})
    log = capsys.readouterr().out  # the task log: the operator's messages
    manifest = committed_manifest(str(out))
    assert manifest["counts"] == {"input_rows": ROWS, "output_rows": ROWS - 1, "error_rows": 1}
    scored = pq.read_table([str(out / f["name"]) for f in manifest["files"]])
    # every committed row is scored from the input and params of the retry, none from the first try's
    assert dict(zip(scored["ticket_id"].to_pylist(), scored["length"].to_pylist(), strict=True)) == {
        i: len(t) + offset for i, t in _texts(inputs).items() if i != BAD_ROW
    }
    if field is None:
        assert manifest["resume"]["kept_rows"] >= 100 and "differs in" not in log
        assert f"SaveMode.RESUME: keeping the parts of earlier attempts in {out}" in log
    else:
        assert manifest["resume"]["kept_rows"] == 0
        assert f"SaveMode.RESUME: the earlier attempt in {out} differs in {field} (" in log


# --- a zombie of another input writes into the directory, then the task resumes ----------------------------


def _stopped(pid: int, timeout_s: float = 120) -> bool:
    """Whether process ``pid`` stopped itself (state ``T`` in /proc) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("T", "t"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_late_part_of_a_frozen_try_of_the_old_input_is_never_kept_by_a_resume(
    offset_model, tmp_path, monkeypatch, capsys
):
    """Try 1 (input v1) is frozen mid-job, after its first part (a real runtime process, SIGSTOP).
    ``data_prep`` writes a fixed input (v2) elsewhere; try 2 starts over and dies on a bad row after
    its own first part. Try 1 thaws, writes its v1 part into try 2's directory and is fenced at its
    commit. Try 3 resumes try 2's claim: it keeps try 2's part, deletes try 1's late one, and commits
    only rows scored from v2."""
    from tests.resume_models import PAUSE_POINT

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # scored in the runtime's own process, in input order
    monkeypatch.setenv("BATCHINFER_WARM_RUNTIME", "0")  # each try's runtime is a fresh process
    v1 = write_tickets(tmp_path / "v1", rows=ROWS, files=2)
    v2 = write_tickets(tmp_path / "v2", rows=ROWS, files=2, bad_row=BAD_ROW)
    _rewrite_texts(v2)
    out = tmp_path / "out"

    first = _operator(v1, out, offset=0)
    failure: list[BaseException] = []

    def run_first() -> None:
        try:
            first.execute({"ti": TaskInstanceStandIn(try_number=1)})
        except BaseException as exc:  # fenced at its commit
            failure.append(exc)

    monkeypatch.setenv(PAUSE_ENV, PAUSE_POINT)
    task = threading.Thread(target=run_first)
    task.start()
    deadline = time.monotonic() + 120
    while (first._launcher is None or first._launcher._proc is None) and task.is_alive():
        assert time.monotonic() < deadline, "try 1 never started its runtime"
        time.sleep(0.05)
    assert first._launcher is not None and first._launcher._proc is not None, f"try 1 ended early: {failure}"
    zombie = first._launcher._proc.pid
    try:
        assert _stopped(zombie), f"try 1 never stopped at {PAUSE_POINT}: {failure}"
        monkeypatch.delenv(PAUSE_ENV)
        zombie_attempt = rundir.read_claim(Stage.open(str(out))).attempt

        with pytest.raises(AirflowException, match="cannot score text 'boom'"):
            _operator(v2, out, offset=0).execute({"ti": TaskInstanceStandIn(try_number=2)})
        second = rundir.read_claim(Stage.open(str(out)))

        os.kill(zombie, signal.SIGCONT)
        task.join(timeout=180)
    finally:
        if task.is_alive():
            os.kill(zombie, signal.SIGKILL)
            task.join(timeout=60)
    assert failure and "is no longer the owner" in str(failure[0]), failure
    late = sorted(p.name for p in out.glob(f"part-*-{zombie_attempt}.parquet"))
    assert late, "the frozen try wrote no late part"
    assert not (out / SUCCESS_MARKER).exists()

    retry = _operator(v2, out, offset=0, on_error="dead_letter", max_error_fraction=0.05)
    capsys.readouterr()
    retry.execute({"ti": TaskInstanceStandIn(try_number=3)})
    manifest = committed_manifest(str(out))
    assert manifest["counts"] == {"input_rows": ROWS, "output_rows": ROWS - 1, "error_rows": 1}
    assert set(late) <= set(manifest["resume"]["removed_files"])
    assert not any(zombie_attempt in f["name"] for f in manifest["files"] + manifest["error_files"])
    assert not list(out.glob(f"part-*-{zombie_attempt}.parquet"))
    assert manifest["resume"]["kept_rows"] >= 100  # try 2's part
    assert second.resumable_attempts == (second.attempt,)  # another input: try 2 inherited nothing
    assert rundir.read_claim(Stage.open(str(out))).resumable_attempts[:1] == (second.attempt,)
    scored = pq.read_table([str(out / f["name"]) for f in manifest["files"]])
    assert dict(zip(scored["ticket_id"].to_pylist(), scored["length"].to_pylist(), strict=True)) == {
        i: len(t) for i, t in _texts(v2).items() if i != BAD_ROW
    }


# --- the one definition, without a job ------------------------------------------------------------------


def _result(flavor="python", signature=None, connection_engine=None, input_spec=None, **job):
    return result_identity(
        input_fingerprint=[["/in/a.parquet", 10, 1]],
        model_sha256="a" * 64,
        input_spec=input_spec or InputSpec(id_column="id"),
        job_spec=JobSpec(**job),
        model_flavor=flavor,
        model_signature=signature if signature is not None else SIGNATURE,
        connection_engine=connection_engine,
    )


def _job_identity(result, **job):
    from airflow_provider_batchinfer.contract import RunOwner

    return job_identity(
        RunOwner("d", "t", "r", try_number=1),
        run_dir="/stage/out",
        result=result,
        model="m/v1",
        input_spec=InputSpec(id_column="id"),
        job_spec=JobSpec(**job),
        save_mode=SaveMode.RESUME,
    )


def test_the_result_identity_has_a_digest_per_field_and_execution_settings_are_not_in_it():
    base = _result()
    assert list(base) == ["version", *RESULT_FIELDS] and all(len(v) == 64 for k, v in base.items() if k != "version")
    execution = {"replicas": 4, "num_workers": 2, "num_cpus": 2.0, "max_batch_rows": 7, "resource_wait_s": 1.0}
    assert _result(**execution) == base  # a RESUME may change how rows are computed ...
    # ... but not re-attach to a job running with other settings: the job identity holds them
    assert _job_identity(base, **execution) != _job_identity(base)
    # the job identity is made from the result identity: any field of it changes the job identity too
    assert _job_identity(_result(rows_per_part=10)) != _job_identity(base)
    outputs = {"inputs": SIGNATURE["inputs"], "outputs": {"length": "int32"}}
    assert result_differences(base, _result(signature=outputs)) == ["output_schema"]


def test_a_text_generation_model_s_engine_is_the_one_that_would_run_it():
    """``JobSpec.engine`` None: the connection's ``llm_engine`` decides, else GPUs mean vLLM."""
    llm = "text_generation"
    on_cpu = _result(flavor=llm)
    assert result_differences(on_cpu, _result(flavor=llm, connection_engine="vllm")) == ["engine"]
    assert result_differences(on_cpu, _result(flavor=llm, num_gpus=1)) == ["engine"]
    assert _result(flavor=llm, engine="transformers", num_gpus=1) == _result(flavor=llm, engine="transformers")
    assert _result(num_gpus=1) == _result()  # other flavors: where a replica runs is an execution setting


def test_the_job_file_records_the_result_field_by_field_and_older_ones_read_without_it(tmp_path):
    from airflow_provider_batchinfer.contract import ContractError, JobFile
    from tests.runs import job_file

    job = dataclasses.replace(job_file(tmp_path), result=_result())
    assert json.loads(job.to_json())["result"] == _result()
    assert JobFile.from_json(job.to_json()) == job
    older = json.loads(job.to_json())
    del older["result"]
    assert JobFile.from_json(json.dumps(older)).result is None
    with pytest.raises(ContractError, match=r"_job.json.result must map field names to digest strings"):
        JobFile.from_json(json.dumps({**older, "result": {"input": 3}}))


def test_an_s3_input_rewritten_with_the_same_size_in_the_same_second_is_another_input(s3_bucket, s3_server):
    """S3's ``LastModified`` is to the second: an input rewritten in place with the same size and
    other values inside that second would look unchanged by size and time. The fingerprint takes
    each object's ETag from the same listing, and the ETag names the content."""
    import boto3

    from airflow_provider_batchinfer.store.identity import parquet_fingerprint

    client = boto3.client(
        "s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="AKIDTEST", aws_secret_access_key="x"
    )
    options = {"endpoint_url": s3_server, "region": "us-east-1", "access_key": "AKIDTEST", "secret_key": "x"}
    location = f"s3://{s3_bucket}/prepared"
    client.put_object(Bucket=s3_bucket, Key="prepared/part-0.parquet", Body=b"A" * 64)
    client.put_object(Bucket=s3_bucket, Key="prepared/_SUCCESS", Body=b"{}")  # not an input file
    before = parquet_fingerprint([location], options)
    client.put_object(Bucket=s3_bucket, Key="prepared/part-0.parquet", Body=b"B" * 64)
    after = parquet_fingerprint([location], options)
    assert [entry[:2] for entry in before] == [[f"{location}/part-0.parquet", 64]]
    assert [entry[:2] for entry in after] == [entry[:2] for entry in before]  # same name, same size
    assert before != after
    single = parquet_fingerprint([f"{location}/part-0.parquet"], options)
    assert single == after
