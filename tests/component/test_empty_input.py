"""An input without rows, run by the runtime in this process (Ray refused outright: nothing to read
or score must start nothing): ``InputSpec(on_empty="commit")`` commits an empty, valid ``_SUCCESS``;
``"fail"`` (the default) and ``"skip"`` fail the job permanently with the same message, which the
operator turns into a failed or a skipped task (tests/e2e/test_empty_input.py)."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER
from airflow_provider_batchinfer.contract.specs import InputSpec
from airflow_provider_batchinfer.store.inputs import InputError
from tests.models import committed_manifest, job_file, write_job_file


@pytest.fixture
def empty_job(monkeypatch, text_length_model, registry, tmp_path):
    """``run(inputs, **input_spec)``: the runtime's ``run`` of a job file over ``inputs``; (run dir, manifest)."""
    import ray

    from airflow_provider_batchinfer.runtime import driver

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started, but an input without rows has nothing to score")

    monkeypatch.setattr(ray, "init", refuse)

    def run(inputs, name="out", **spec):
        run_dir = tmp_path / name
        run_dir.mkdir()
        job = job_file(
            run_dir, text_length_model, registry.root, [str(i) for i in inputs], input_spec=InputSpec(**spec)
        )
        return run_dir, driver.run(write_job_file(job))

    return run


def _zero_rows(path, **columns):
    schema = columns or {"ticket_id": pa.int64(), "text": pa.string()}
    pq.write_table(pa.table({name: pa.array([], kind) for name, kind in schema.items()}), path)
    return path


def test_on_empty_commit_commits_an_empty_valid_success_for_files_of_0_rows_or_no_files(empty_job, tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    day = tmp_path / "day"
    day.mkdir()
    _zero_rows(day / "a.parquet")
    _zero_rows(day / "b.parquet")
    for name, inputs in (("no-files", [tmp_path / "nothing"]), ("zero-rows", [day])):
        run_dir, manifest = empty_job(inputs, name=name, id_column="ticket_id", on_empty="commit")
        assert 'InputSpec(on_empty="commit"): committing an empty _SUCCESS' in capsys.readouterr().out
        assert manifest.files == () and manifest.error_files == ()
        assert (manifest.counts.input_rows, manifest.counts.output_rows, manifest.counts.error_rows) == (0, 0, 0)
        committed = committed_manifest(str(run_dir))  # re-read and validated as the sensor and finalize read it
        assert committed is not None and committed["counts"] == {"input_rows": 0, "output_rows": 0, "error_rows": 0}
        assert committed["files"] == [] and committed["columns"] == {
            "passthrough": ["ticket_id"],
            "outputs": ["length"],
        }
        assert sorted(p.name for p in run_dir.iterdir() if p.name != "_claims") == sorted(
            [JOB_SPEC_FILE, SUCCESS_MARKER]
        )
    assert manifest.input_files == tuple(str(day / n) for n in ("a.parquet", "b.parquet"))


@pytest.mark.parametrize("on_empty", ["fail", "skip"])
def test_an_input_without_rows_fails_permanently_unless_it_commits(empty_job, tmp_path, on_empty):
    """ "skip" fails the job as "fail" does: the operator reads the error's type and skips the task."""
    from airflow_provider_batchinfer.runtime.reporting import failure

    (tmp_path / "nothing").mkdir()
    empty = _zero_rows(tmp_path / "empty.parquet")
    for name, inputs, message in (
        ("zero-rows", [empty], r"holds 0 rows; nothing to score"),
        ("no-files", [tmp_path / "nothing"], r"holds no Parquet files; nothing to score"),
    ):
        with pytest.raises(InputError, match=message) as caught:
            empty_job(inputs, name=name, on_empty=on_empty)
        found = failure(caught.value)
        assert found.permanent and found.type == "EmptyInputError", found
        assert 'on_empty="skip") or on_empty="commit" when a run legitimately has no rows' in found.error
        run_dir = tmp_path / name
        assert not (run_dir / SUCCESS_MARKER).exists()


def test_a_file_of_0_rows_is_still_checked_against_the_model(empty_job, tmp_path):
    """Committing an empty day must not hide a data_prep that wrote the wrong columns."""
    empty = _zero_rows(tmp_path / "empty.parquet", ticket_id=pa.int64(), body=pa.string())
    with pytest.raises(InputError, match=r"model input 'text' needs column 'text'"):
        empty_job([empty], on_empty="commit")
    assert not (tmp_path / "out" / SUCCESS_MARKER).exists()


# --- a SQL input whose query returns no rows ---------------------------------------------------------

DAY_QUERY = "SELECT ticket_id, text FROM tickets WHERE day = '2026-11-24' ORDER BY ticket_id"


@pytest.fixture
def empty_day_db(batchinfer_home, text_length_model, tmp_path, monkeypatch):
    """A SQLite table with rows for 2026-11-23 and none for 2026-11-24, behind an Airflow connection;
    ``operator(on_empty, out)``: the task that scores the empty day, on the embedded default."""
    import json
    import sqlite3
    from contextlib import closing

    from airflow_provider_batchinfer import BatchInferenceOperator
    from airflow_provider_batchinfer.contract.specs import OutputSpec

    db = tmp_path / "tickets.db"
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("CREATE TABLE tickets (ticket_id INTEGER PRIMARY KEY, day TEXT, text TEXT)")
        conn.executemany("INSERT INTO tickets VALUES (?, '2026-11-23', ?)", [(i, f"ticket {i}") for i in range(5)])
    monkeypatch.setenv("AIRFLOW_CONN_BI_EMPTY_DAY", json.dumps({"conn_type": "sqlite", "host": str(db)}))

    def operator(on_empty, out):
        return BatchInferenceOperator(
            task_id="infer",
            model="text_length",
            version="v1",
            sql=DAY_QUERY,
            conn_id="bi_empty_day",
            input_spec=InputSpec(id_column="ticket_id", on_empty=on_empty),
            output_spec=OutputSpec(stage_location=str(out)),
        )

    return operator


def _left_in(out) -> list[str]:
    """What a run directory holds besides its claim: the query's read directory and anything written."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and "_claims" not in p.parts)


@pytest.mark.parametrize("on_empty", ["fail", "skip"])
def test_a_query_without_rows_fails_permanently_or_skips_as_on_empty_says(empty_day_db, tmp_path, on_empty):
    """The job reads the query (the task process never does), finds no rows and fails permanently with
    the query's message: the operator fails the task without retries, or skips it under "skip"."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from tests.task_context import TaskInstanceStandIn

    message = r"the input query on 'bi_empty_day' returned no rows; nothing to score\. Check the query"
    error, match = {
        "fail": (AirflowFailException, message),
        "skip": (AirflowSkipException, r'the task is skipped \(InputSpec\(on_empty="skip"\)\).*' + message),
    }[on_empty]
    out = tmp_path / "out"
    with pytest.raises(error) as caught:
        empty_day_db(on_empty, out).execute({"ti": TaskInstanceStandIn()})
    assert type(caught.value) is error  # "fail": not a plain, retryable AirflowException
    assert re.search(match, str(caught.value)), str(caught.value)
    assert 'on_empty="skip") or on_empty="commit" when a run legitimately has no rows' in str(caught.value)
    assert _left_in(out) == [JOB_SPEC_FILE], _left_in(out)  # claimed, nothing committed


def test_a_query_without_rows_commits_an_empty_valid_success_under_on_empty_commit(empty_day_db, tmp_path, capfd):
    from tests.task_context import TaskInstanceStandIn

    out = tmp_path / "out-commit"
    result = empty_day_db("commit", out).execute({"ti": TaskInstanceStandIn()})
    assert result["rows"] == 0 and result["input_rows"] == 0 and result["files"] == []
    committed = committed_manifest(str(out))  # re-read and validated as the sensor and finalize read it
    assert committed is not None and committed["counts"] == {"input_rows": 0, "output_rows": 0, "error_rows": 0}
    assert committed["files"] == [] and committed["error_files"] == []
    assert committed["columns"] == {"passthrough": ["ticket_id"], "outputs": ["length"]}
    assert _left_in(out) == sorted([JOB_SPEC_FILE, SUCCESS_MARKER])
    logged = "".join(capfd.readouterr())
    assert "0 rows of the query on bi_empty_day read in the driver process" in logged
    assert 'InputSpec(on_empty="commit"): committing an empty _SUCCESS' in logged
