"""A corrupt Parquet file among good ones fails the job permanently, naming the file, on both engines,
and commits nothing.

A file cut short, with bad magic bytes or an unreadable footer fails the footer checks every job
runs before its engine starts (through the operator here: the task fails without its retries). A
file whose footer is intact but whose pages do not decode passes those checks and is found by the
engine's own read: the driver's reader (in-driver engine), and on the actor pool Ray Data's read
(in read tasks, or fused into the replicas). The unit tests (tests/unit/test_parquet_read.py) cover each kind of damage on each reader
without Ray."""

from __future__ import annotations

import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec
from tests.corrupt_inputs import damage
from tests.models import write_tickets
from tests.task_context import TaskInstanceStandIn

from airflow.sdk.exceptions import AirflowFailException  # isort: skip

ENGINES = {
    "in_driver": JobSpec(max_batch_rows=50),  # one CPU replica on the embedded default: scored in the driver
    "pool": JobSpec(max_batch_rows=50, replicas=2, in_driver_max_rows=0),  # the actor pool, on the session's cluster
}


def _operator(inputs, out, job_spec):
    from airflow_provider_batchinfer import BatchInferenceOperator

    return BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=str(inputs),
        input_spec=InputSpec(columns=["ticket_id", "text"]),
        output_spec=OutputSpec(stage_location=str(out)),
        job_spec=job_spec,
    )


@pytest.mark.usefixtures("airflow_db")
@pytest.mark.parametrize(("engine", "how"), [(e, h) for e in sorted(ENGINES) for h in ("truncated", "bad_pages")])
def test_a_corrupt_file_among_good_ones_fails_the_task_without_retries_naming_it(
    batchinfer_home, text_length_model, tmp_path, request, monkeypatch, engine, how
):
    if engine == "pool":  # the session's Ray cluster
        monkeypatch.setenv("RAY_ADDRESS", request.getfixturevalue("ray_cluster")["address"])
    job_spec = ENGINES[engine]
    # the pool reads more files than Tuning.driver_read_files on Ray, not as a small input in its driver
    # (that read is tests/unit/test_parquet_read.py's)
    files = 65 if engine == "pool" else 3
    inputs = write_tickets(tmp_path / "in", rows=2 * files, files=files)
    bad = damage(inputs / "tickets-01.parquet", how)
    out = tmp_path / "out"
    with pytest.raises(AirflowFailException) as caught:  # permanent: not a plain, retryable AirflowException
        _operator(inputs, out, job_spec).execute({"ti": TaskInstanceStandIn()})
    message = str(caught.value)
    assert f"input file {bad} is not a readable Parquet file" in message, message
    assert "truncated or corrupt, and a retry reads the same bytes" in message
    assert not (out / SUCCESS_MARKER).exists()  # nothing committed: no reader trusts a part without it
    if how == "truncated":  # found by the checks before any engine: not a row was scored
        assert not list(out.glob("part-*"))
