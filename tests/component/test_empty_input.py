"""An input without rows, run by the runtime in this process (Ray refused outright: nothing to read
or score must start nothing): ``InputSpec(on_empty="commit")`` commits an empty, valid ``_SUCCESS``;
``"fail"`` (the default) and ``"skip"`` fail the job permanently with the same message, which the
operator turns into a failed or a skipped task (tests/e2e/test_empty_input.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.inputs import InputError
from airflow_provider_batchinfer.specs import InputSpec
from airflow_provider_batchinfer.stage import JOB_SPEC_FILE, SUCCESS_MARKER
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
