"""Bad input that no retry can fix fails the job permanently, with a message naming the file, column
or id: the runtime, run in this process (Ray refused outright: each fails before any compute), says
``permanent`` on its error line, so the operator fails the task without its retries. A store that
failed to answer stays retryable."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE
from airflow_provider_batchinfer.contract.specs import InputSpec
from airflow_provider_batchinfer.store.inputs import InputError
from tests.models import job_file, write_job_file


@pytest.fixture
def fails(monkeypatch, text_length_model, registry, tmp_path):
    """``fails(inputs, **input_spec)``: the runtime's ``run`` of a job over ``inputs`` must raise an
    InputError and leave only its claim; what its error line says (``reporting.failure``)."""
    import ray

    from airflow_provider_batchinfer.runtime import driver
    from airflow_provider_batchinfer.runtime.reporting import failure

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started, but this bad input must fail before any compute")

    monkeypatch.setattr(ray, "init", refuse)

    def run(inputs, **spec):
        run_dir = tmp_path / "out"
        job = job_file(
            run_dir, text_length_model, registry.root, [str(i) for i in inputs], input_spec=InputSpec(**spec)
        )
        with pytest.raises(InputError) as caught:
            driver.run(write_job_file(job))
        assert sorted(p.name for p in run_dir.iterdir() if p.name != "_claims") == [JOB_SPEC_FILE]  # no part, no marker
        return failure(caught.value)

    return run


def _tickets(path, ids, texts=None, **extra):
    columns = {"ticket_id": pa.array(ids, pa.int64()), "text": pa.array(texts or [f"t{i}" for i in ids]), **extra}
    pq.write_table(pa.table(columns), path)
    return path


@pytest.mark.parametrize(
    "case",
    ["missing column", "missing id column", "duplicated id", "null id", "types differ across files"],
)
def test_bad_input_fails_permanently_naming_file_column_or_id(fails, tmp_path, case):
    first = _tickets(tmp_path / "a.parquet", [1, 2, 3])
    if case == "missing column":
        bad = tmp_path / "b.parquet"
        pq.write_table(pa.table({"ticket_id": [4, 5], "body": ["d", "e"]}), bad)
        found = fails([bad])
        expected = rf"model input 'text' needs column 'text', which the input {bad} does not have"
    elif case == "missing id column":
        found = fails([first], id_column="row_id")
        expected = rf"InputSpec.id_column 'row_id' is not a column of {first}"
    elif case == "duplicated id":
        _tickets(tmp_path / "b.parquet", [4, 2])
        found = fails([tmp_path / "a.parquet", tmp_path / "b.parquet"], id_column="ticket_id")
        expected = r"id column 'ticket_id' is not unique: 1 value\(s\) appear more than once \(e.g. 2 appears 2 times\)"
    elif case == "null id":
        pq.write_table(
            pa.table({"ticket_id": pa.array([4, None], pa.int64()), "text": ["d", "e"]}), tmp_path / "b.parquet"
        )
        found = fails([first, tmp_path / "b.parquet"], id_column="ticket_id")
        expected = r"id column 'ticket_id' has 1 null value\(s\); every row needs an id"
    else:
        bad = tmp_path / "b.parquet"
        pq.write_table(pa.table({"ticket_id": pa.array(["4", "5"]), "text": ["d", "e"]}), bad)
        found = fails([first, bad])
        expected = rf"input file {bad} has a different schema from {first}: \['ticket_id: int64', 'ticket_id: string'\]"
    assert found.permanent, f"{case}: a retry reads the same input, so the task must fail without its retries"
    assert re.search(expected, found.error), found.error
    assert found.type == "InputError", found


def test_pages_that_do_not_decode_fail_the_id_check_permanently_naming_the_file(fails, tmp_path):
    """The footer is intact, so the row count and schema checks pass; the id check reads the pages
    first, before either engine, and names the file."""
    from tests.corrupt_inputs import damage

    files = [_tickets(tmp_path / f"tickets-{n}.parquet", list(range(n * 50, n * 50 + 50))) for n in range(3)]
    damage(files[1], "bad_pages")
    found = fails(files, id_column="ticket_id")
    assert f"input file {files[1]} is not a readable Parquet file" in found.error, found.error
    assert found.permanent and found.type == "CorruptInputError", found


def test_a_file_gone_between_the_listing_and_the_read_stays_retryable(tmp_path):
    """Not the input's bytes: a store (or a data_prep still writing) that a retry may find answering."""
    from airflow_provider_batchinfer.runtime.reporting import failure
    from airflow_provider_batchinfer.store.inputs import InputReadError, inspect_input

    gone = tmp_path / "gone.parquet"
    with pytest.raises(InputReadError, match=rf"input file {gone} could not be read") as caught:
        inspect_input([str(gone)], None)
    assert not failure(caught.value).permanent
