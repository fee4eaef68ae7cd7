"""The Ray side's planning logic, without starting Ray: column checks, error messages."""

from __future__ import annotations

import pyarrow as pa
import pytest

from airflow_provider_batchinfer.contract.specs import InputSpec
from airflow_provider_batchinfer.runtime.planning.pipeline import plan_columns
from airflow_provider_batchinfer.runtime.reporting import _root_message
from airflow_provider_batchinfer.store.inputs import InputError

SCHEMA = pa.schema([("ticket_id", pa.int64()), ("body", pa.string()), ("score", pa.float64())])
SIG = {"inputs": {"text": "string"}, "outputs": {"embedding": "list<float32>"}}


def test_plan_reads_model_inputs_and_passes_the_rest_through():
    plan = plan_columns(SCHEMA, SIG, InputSpec(column_mapping={"body": "text"}), "in.parquet")
    assert plan["sources"] == ["body"] and plan["model_inputs"] == ["text"]
    assert plan["passthrough"] == ["ticket_id", "score"]
    plan = plan_columns(SCHEMA, SIG, InputSpec(columns=["ticket_id", "body"], column_mapping={"body": "text"}), "in")
    assert plan["read"] == ["body", "ticket_id"]


def test_plan_names_the_missing_or_mistyped_column_before_any_compute():
    with pytest.raises(
        InputError,
        match=r"model input 'text' needs column 'text', which the input in.parquet does not have.*column_mapping",
    ):
        plan_columns(SCHEMA, SIG, InputSpec(), "in.parquet")
    with pytest.raises(
        InputError, match=r"column 'score' of in.parquet is double, but model input 'text' expects string"
    ):
        plan_columns(SCHEMA, SIG, InputSpec(column_mapping={"score": "text"}), "in.parquet")
    with pytest.raises(InputError, match=r"passthrough columns \['embedding'\] have the same names as model outputs"):
        schema = SCHEMA.append(pa.field("embedding", pa.string()))
        plan_columns(schema, SIG, InputSpec(column_mapping={"body": "text"}), "in.parquet")
    with pytest.raises(InputError, match=r"InputSpec.columns \['nope'\] are not in the input"):
        plan_columns(SCHEMA, SIG, InputSpec(columns=["nope"]), "in.parquet")


# the actor pool's sizing and the cluster's resources: tests/e2e/test_resources.py


def test_root_message_unwraps_chained_errors():
    try:
        try:
            raise ValueError("cannot score text 'boom'")
        except ValueError as inner:
            raise RuntimeError("Traceback ...\nlots of ray text") from inner
    except RuntimeError as exc:
        assert _root_message(exc) == "ValueError: cannot score text 'boom'"


def test_root_message_finds_the_user_error_inside_ray_wrappers():
    class UserCodeException(Exception):
        pass

    wrapped = UserCodeException(
        'ray::MapWorker(MapBatches(A)).submit()\n  File "m.py", line 6, in __call__\n'
        "    raise ValueError(\"cannot score text 'boom' (row 3)\")\nValueError: cannot score text 'boom' (row 3)\n\n"
        "ray.exceptions.UserCodeException: UDF failed to process a data block."
    )
    assert _root_message(wrapped) == "ValueError: cannot score text 'boom' (row 3)"


def test_root_message_prefers_our_model_batch_error_in_a_ray_traceback():
    class UserCodeException(Exception):
        pass

    wrapped = UserCodeException(
        "ray::MapWorker(MapBatches(ModelReplica)).submit()\n"
        "ValueError: cannot score text 'boom' (row 3)\n\nThe above exception was the direct cause of the following "
        "exception:\n\nairflow_provider_batchinfer.runtime.errors.ModelBatchError: ValueError: "
        "cannot score text 'boom' (row 3), raised by model m/v1 on the batch of 8 row(s) with id 0..7; nothing "
        "was committed\n"
        "ray.exceptions.UserCodeException: UDF failed to process a data block."
    )
    assert _root_message(wrapped) == (
        "ValueError: cannot score text 'boom' (row 3), raised by model m/v1 "
        "on the batch of 8 row(s) with id 0..7; nothing was committed"
    )


def test_batch_range_names_ids_or_rows():
    from airflow_provider_batchinfer.runtime.errors import batch_range

    batch = pa.table({"ticket_id": [7, 3, 9], "text": ["a", "b", "c"]})
    assert batch_range(batch, "ticket_id") == "the batch of 3 row(s) with ticket_id 3..9"
    assert batch_range(batch, None).startswith("a batch of 3 row(s) (rows 0..2 of the batch; set InputSpec(id_column")


def test_the_counter_times_the_batches_reports_for_a_job_shorter_than_one_progress_report(monkeypatch):
    """The progress log's steady rate needs a report that saw rows and rows after it; a job that
    scores within one interval gets its rate from the counter instead: the rows reported after the
    first report, over the time from the first report to the last (empty reports start nothing)."""
    from airflow_provider_batchinfer.runtime.engine.progress import ProgressLog
    from airflow_provider_batchinfer.runtime.output import parts as io

    clock = iter([9.0, 10.0, 12.0, 14.0])
    monkeypatch.setattr(io.time, "monotonic", lambda: next(clock))
    counter = io.ProgressCounter()
    assert counter.reported_rate() is None
    counter.add(0)  # a block RESUME filtered empty
    counter.add(100)
    assert counter.reported_rate() is None  # one report: no span yet
    counter.add(300)
    counter.add(100)
    assert counter.get() == 500 and counter.reported_rate() == 100.0  # 400 rows over 4 s
    monkeypatch.undo()  # the real clock again

    log = ProgressLog(lambda: 0, 500, 10.0)
    assert log.steady_rate(20.0, 500) is None  # no report saw rows
    log.first_rows_at, log.first_rows = 10.0, 500
    assert log.steady_rate(20.0, 500) is None  # the first report saw them all: no rate, not 0
    log.first_rows = 300
    assert log.steady_rate(20.0, 500) == 20.0
