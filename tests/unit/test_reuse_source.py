"""Which earlier run incremental scoring copies rows from, attacked on a local base location: only
this task's own committed runs, newest by the store's commit order (never by a date the writer
put in the manifest), and only when their content still matches their checksums."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE
from airflow_provider_batchinfer.store.stage import Stage
from tests.reuse_runs import CONTEXT, committed, owner, source_job


def _at(**delta: float) -> str:
    """An ISO date relative to now (``days=-2``: two days ago)."""
    return (datetime.now(timezone.utc) + timedelta(**delta)).isoformat()


def _find(base, job=None):
    from airflow_provider_batchinfer.runtime.incremental.source import find_source

    notes: list[str] = []
    return find_source(Stage.open(str(base)), job or source_job(base), CONTEXT, notes), "\n".join(notes)


@pytest.mark.parametrize(
    ("committed_at", "finished_at", "match"),
    [
        pytest.param(_at(hours=-1), _at(days=365), "in the future (now", id="finished_at-in-the-future"),
        pytest.param(_at(days=365), _at(hours=-1), "the store dates its _SUCCESS", id="store-time-in-the-future"),
        pytest.param(_at(hours=-1), _at(minutes=-1), "after its _SUCCESS was committed", id="finished-after-commit"),
    ],
)
def test_a_marker_dated_in_the_future_is_never_the_source(tmp_path, committed_at, finished_at, match):
    base = tmp_path / "base"
    older = committed(base, "d1", _at(days=-2))
    future = committed(base, "d2", committed_at, finished_at=finished_at)
    source, notes = _find(base)
    assert source is not None and source.run_dir == str(older)
    assert f"skipped {future}: " in notes and match in notes


def test_the_newest_commit_is_chosen_by_the_store_not_by_finished_at(tmp_path):
    base = tmp_path / "base"
    committed(base, "d1", _at(hours=-2))  # says it finished later than d2 says ...
    latest = committed(base, "d2", _at(hours=-1), finished_at=_at(days=-3))  # ... but d2 committed last
    source, _notes = _find(base)
    assert source is not None and source.run_dir == str(latest)


@pytest.mark.parametrize(
    "change",
    [{"dag_id": "other_dag"}, {"task_id": "other_task"}],
    ids=["another-dag", "another-task"],
)
def test_another_tasks_output_under_the_same_base_is_never_the_source(tmp_path, change):
    base = tmp_path / "base"
    own = committed(base, "d1", _at(days=-2))
    committed(base, "d2", _at(hours=-1), writer=owner("d2", **change))  # newer, same model and context
    source, notes = _find(base)
    assert source is not None and source.run_dir == str(own)
    assert "1 committed run(s)" in notes and "another task's output is never reused" in notes


def test_another_map_index_is_never_the_source(tmp_path):
    base = tmp_path / "base"
    own = committed(base, "d1", _at(days=-2), map_index=0)
    # a marker in map-0 of a newer run, written by map index 1
    committed(base, "d2", _at(hours=-1), map_index=0, writer=owner("d2", map_index=1))
    source, notes = _find(base, source_job(base, map_index=0))
    assert source is not None and source.run_dir == str(own)
    assert "another task's output is never reused" in notes


@pytest.mark.parametrize(
    ("claim", "match"),
    [
        (
            {"claimant": owner("d2", task_id="other_task")},
            "its _job.json names dag.other_task (map index -1) attempt t01aaaa",
        ),
        ({"claim": False}, f"it has no {JOB_SPEC_FILE}, so nothing says which task committed it"),
    ],
    ids=["claimed-by-another-task", "no-claim"],
)
def test_a_marker_whose_claim_is_not_this_tasks_is_never_the_source(tmp_path, claim, match):
    """The manifest says this task, the run directory's claim does not (or there is none)."""
    base = tmp_path / "base"
    own = committed(base, "d1", _at(days=-2))
    other = committed(base, "d2", _at(hours=-1), **claim)
    source, notes = _find(base)
    assert source is not None and source.run_dir == str(own)
    assert f"skipped {other}: {match}" in notes


def test_a_claim_by_a_newer_attempt_is_never_the_source(tmp_path):
    """The run directory was claimed again after its commit: the marker's attempt no longer owns it."""
    from tests.runs import job_file

    base = tmp_path / "base"
    own = committed(base, "d1", _at(days=-2))
    taken = committed(base, "d2", _at(hours=-1))
    (taken / JOB_SPEC_FILE).write_text(job_file(taken, attempt="t02bbbb", owner=owner("d2")).to_json())
    source, notes = _find(base)
    assert source is not None and source.run_dir == str(own)
    assert f"skipped {taken}: its {JOB_SPEC_FILE} names dag.infer (map index -1) attempt t02bbbb" in notes


def test_a_run_whose_part_has_one_flipped_byte_is_never_the_source(tmp_path):
    """Its predictions would be copied into a new commit under fresh checksums."""
    from tests.damage import flip_data_page_byte

    base = tmp_path / "base"
    own = committed(base, "d1", _at(days=-2))
    damaged = committed(base, "d2", _at(hours=-1))
    flip_data_page_byte(damaged / "part-00000-t01a.parquet")
    source, notes = _find(base)
    assert source is not None and source.run_dir == str(own)
    assert f"skipped {damaged}: {damaged}/part-00000-t01a.parquet does not match its sha256" in notes
