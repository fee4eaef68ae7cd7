"""``InputSpec(on_empty=...)`` through Airflow: a daily DAG whose day legitimately has no rows fails
(the default, without retries), skips, or commits an empty ``_SUCCESS`` that the downstream sensor
accepts. The runtime's side (what is committed, what is checked) is tested in
tests/component/test_empty_input.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER
from airflow_provider_batchinfer.contract.specs import InputSpec, OutputSpec
from airflow_provider_batchinfer.store.locations import sanitize_run_key
from tests.conftest import run_dag, xcom_value
from tests.task_context import TaskInstanceStandIn

from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException  # isort: skip


@pytest.mark.usefixtures("airflow_db")
def test_a_day_without_rows_fails_skips_or_commits_0_rows_as_on_empty_says(
    batchinfer_home, text_length_model, tmp_path
):
    day = tmp_path / "day.parquet"
    pq.write_table(pa.table({"ticket_id": pa.array([], pa.int64()), "text": pa.array([], pa.string())}), day)
    out = tmp_path / "out"
    state, tasks, run_id = run_dag("bi_test_empty_input", input=str(day), out=str(out))
    assert state == "failed"  # its on_empty="fail" task failed
    assert tasks == {
        "on_empty_fail": ("failed", 1),  # permanent: its two retries are not used
        "on_empty_skip": ("skipped", 1),
        "on_empty_commit": ("success", 1),
        "ready": ("success", 1),  # the downstream gate passes on the empty commit
    }, tasks
    run_dir = out / "commit" / sanitize_run_key(run_id)
    manifest = json.loads((run_dir / SUCCESS_MARKER).read_text())
    assert manifest["counts"] == {"input_rows": 0, "output_rows": 0, "error_rows": 0} and manifest["files"] == []
    committed = xcom_value("bi_test_empty_input", run_id, "on_empty_commit")
    assert committed["rows"] == 0 and committed["input_rows"] == 0 and committed["files"] == []
    for nothing in ("fail", "skip"):  # claimed, never committed
        assert not list((out / nothing).rglob(SUCCESS_MARKER)), nothing


@pytest.mark.usefixtures("airflow_db")
def test_a_directory_without_parquet_files_is_refused_or_skipped_before_anything_is_claimed(
    batchinfer_home, text_length_model, tmp_path
):
    """The operator lists the input before it claims the run directory: an existing directory with no
    Parquet file fails or skips the task there, and with "commit" the job commits 0 rows."""
    from airflow_provider_batchinfer import BatchInferenceOperator

    (tmp_path / "nothing").mkdir()

    def operator(on_empty, out):
        return BatchInferenceOperator(
            task_id="infer",
            model="text_length",
            version="v1",
            input=str(tmp_path / "nothing"),
            input_spec=InputSpec(on_empty=on_empty),
            output_spec=OutputSpec(stage_location=str(out)),
        )

    for on_empty, error, message in (
        ("fail", AirflowFailException, r"holds no Parquet files; nothing to score"),
        ("skip", AirflowSkipException, r'the task is skipped \(InputSpec\(on_empty="skip"\)\).* holds no Parquet'),
    ):
        out = tmp_path / f"out-{on_empty}"
        with pytest.raises(error, match=message) as caught:
            operator(on_empty, out).execute({"ti": TaskInstanceStandIn()})
        assert type(caught.value) is error
        assert not out.exists() or not any(out.iterdir()), "nothing may be claimed or written"
    out = tmp_path / "out-commit"
    result = operator("commit", out).execute({"ti": TaskInstanceStandIn()})
    assert result["rows"] == 0 and result["input_rows"] == 0 and result["files"] == []
    assert (out / SUCCESS_MARKER).exists()
