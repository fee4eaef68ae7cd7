"""A corrupt Parquet file among good ones fails the job permanently, naming the file, on both engines,
and commits nothing.

A file cut short, with bad magic bytes or an unreadable footer fails the footer checks every job
runs before its engine starts (through the operator here: the task fails without its retries). A
file whose footer is intact but whose pages do not decode passes those checks and is found by the
engine's own read: the driver's reader (in-driver engine), and on the actor pool Ray Data's read
tasks. The unit tests (tests/unit/test_parquet_read.py) cover each kind of damage on each reader
without Ray."""

from __future__ import annotations

import dataclasses

import pytest

from airflow_provider_batchinfer.inputs import InputError
from airflow_provider_batchinfer.runtime.reporting import failure
from airflow_provider_batchinfer.specs import InputSpec, JobSpec, OutputSpec
from airflow_provider_batchinfer.stage import SUCCESS_MARKER
from tests.corrupt_inputs import damage
from tests.models import job_file, write_job_file, write_tickets
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
@pytest.mark.parametrize(
    ("engine", "how"),
    # on the pool a small input's pages are read by its driver, as tests/unit/test_parquet_read.py reads
    # them: the test below reads them on Ray
    [("in_driver", "truncated"), ("in_driver", "bad_pages"), ("pool", "truncated")],
)
def test_a_corrupt_file_among_good_ones_fails_the_task_without_retries_naming_it(
    batchinfer_home, text_length_model, tmp_path, request, monkeypatch, engine, how
):
    if engine == "pool":  # the session's Ray cluster
        monkeypatch.setenv("RAY_ADDRESS", request.getfixturevalue("ray_cluster")["address"])
    job_spec = ENGINES[engine]
    inputs = write_tickets(tmp_path / "in", rows=150, files=3)
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


def test_pages_that_do_not_decode_fail_the_pools_read_tasks_naming_the_file(
    ray_cluster, text_length_model, registry, tmp_path, monkeypatch
):
    """Ray Data's read tasks find the damage; its error names the file only in its retry note, and the
    job's error names it as the job file does, permanent. The input is read on the cluster, not as a
    small input in the driver (``Tuning.driver_read_files`` shrunk to 1)."""
    from airflow_provider_batchinfer.runtime import driver, small_input

    monkeypatch.setattr(small_input, "TUNING", dataclasses.replace(small_input.TUNING, driver_read_files=1))
    inputs = write_tickets(tmp_path / "in", rows=150, files=3)
    bad = damage(inputs / "tickets-01.parquet", "bad_pages")
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    job = job_file(
        run_dir,
        text_length_model,
        registry.root,
        [str(inputs)],
        input_spec=InputSpec(columns=["ticket_id", "text"]),
        job_spec=ENGINES["pool"],
        ray_address=ray_cluster["address"],
    )
    with pytest.raises(InputError) as caught:
        driver.run(write_job_file(job))
    found = failure(caught.value)
    assert f"input file {bad} is not a readable Parquet file" in found.error, found.error
    assert found.permanent and found.type == "CorruptInputError"
    assert not (run_dir / SUCCESS_MARKER).exists()
