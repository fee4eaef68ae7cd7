"""Every branch of the run-directory policy (rundir.py) on a local directory: no Ray, no Airflow."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from airflow_provider_batchinfer.contract import (
    INPUT_DIR,
    JOB_SPEC_FILE,
    SUCCESS_MARKER,
    ContractError,
    FileEntry,
    ManifestError,
    RunOwner,
    part_name,
)
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, SaveMode
from airflow_provider_batchinfer.store.commit.rundir import (
    FencedError,
    ForeignRunDirectoryError,
    Preparation,
    ReconcileError,
    RunDirectoryError,
    RunDirectoryNotEmptyError,
    check_fence,
    claim,
    commit,
    confirm_requeried_input,
    prepare,
    read_claim,
)
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.identity import result_identity
from airflow_provider_batchinfer.store.locations import StageError
from airflow_provider_batchinfer.store.stage import Stage
from tests.runs import MODEL, OWNER, committed_run, job_file, manifest_for, write_part

SHA = MODEL.sha256
INPUT = [["/data/in/a.parquet", 100, 1]]


def _result(fingerprint=INPUT, sha=SHA, input_spec=None, **job) -> dict[str, str]:
    """The result identity of the attempts in these tests, with whatever differs from it."""
    return result_identity(
        input_fingerprint=fingerprint,
        model_sha256=sha,
        input_spec=input_spec or InputSpec(id_column="id"),
        job_spec=JobSpec(**job),
        model_flavor=MODEL.flavor,
    )


def _prepare(run: Path, mode: SaveMode, owner: RunOwner = OWNER, **kwargs) -> Preparation:
    args = {"result": _result(), "materialized_input": False}
    args.update(kwargs)
    return prepare(Stage.open(str(run)), owner, mode, **args)


def _files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())


def _earlier_attempt(
    run: Path, owner: RunOwner = OWNER, marker: bool = False, result: dict[str, str] | None = None, **job
) -> list[str]:
    """What an earlier attempt leaves: its claim (recording ``result``, by default the tests' own),
    a part, and (when it committed) the marker."""
    recorded = _result() if result is None else result
    claim(Stage.open(str(run)), dataclasses.replace(job_file(run, owner=owner, **job), result=recorded))
    if marker:
        committed_run(run)
    else:
        write_part(run, part_name(0, "t01aaaa"), [1, 2])
    return _files(run)


def test_errors_say_whether_a_retry_can_help():
    assert ForeignRunDirectoryError.permanent and RunDirectoryNotEmptyError.permanent
    assert not FencedError.permanent and not ReconcileError.permanent
    for cls in (ForeignRunDirectoryError, RunDirectoryNotEmptyError, FencedError, ReconcileError):
        assert issubclass(cls, RunDirectoryError) and issubclass(cls, StageError)


# --- prepare -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(SaveMode))
def test_an_empty_or_absent_directory_is_ready_in_every_mode(tmp_path, mode):
    assert _prepare(tmp_path / "absent", mode) == Preparation(resume=False, removed_files=0, messages=())
    (tmp_path / "empty").mkdir()
    assert _prepare(tmp_path / "empty", mode).resume is False


def test_error_mode_refuses_a_non_empty_directory_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    (run / "x").mkdir(parents=True)
    for i in range(7):
        (run / "x" / f"f{i}.csv").write_text("a")
    with pytest.raises(
        RunDirectoryNotEmptyError,
        match=r"is not empty \(7 file\(s\): x/f0.csv, .* …\) and the save "
        r"mode is SaveMode.ERROR; nothing was changed\. Use "
        r"OutputSpec\(mode=SaveMode.OVERWRITE\)",
    ) as info:
        _prepare(run, SaveMode.ERROR)
    assert info.value.permanent and len(_files(run)) == 7


def test_error_mode_refuses_a_committed_result_of_the_same_task_instance(tmp_path):
    before = _earlier_attempt(tmp_path / "run", marker=True)
    with pytest.raises(RunDirectoryNotEmptyError, match="SaveMode.ERROR"):
        _prepare(tmp_path / "run", SaveMode.ERROR)
    assert _files(tmp_path / "run") == before


def test_error_mode_refuses_another_run_of_the_same_task(tmp_path):
    _earlier_attempt(tmp_path / "run", owner=dataclasses.replace(OWNER, run_id="run0"))
    with pytest.raises(RunDirectoryNotEmptyError):
        _prepare(tmp_path / "run", SaveMode.ERROR)


def test_error_mode_clears_the_uncommitted_leftovers_of_an_earlier_try(tmp_path):
    run = tmp_path / "run"
    _earlier_attempt(run, owner=dataclasses.replace(OWNER, try_number=1))
    done = _prepare(run, SaveMode.ERROR, owner=dataclasses.replace(OWNER, try_number=2))
    assert done.resume is False and done.removed_files == 2 and _files(run) == []
    assert done.messages == (
        "Removing the uncommitted files of an earlier try (try 1) of this task and run",
        f"retry clean-up: removed 2 file(s) (no {SUCCESS_MARKER}) from {run}",
    )


def test_overwrite_removes_the_marker_then_the_rest(tmp_path):
    run = tmp_path / "run"
    before = _earlier_attempt(run, owner=dataclasses.replace(OWNER, run_id="run0"), marker=True)
    done = _prepare(run, SaveMode.OVERWRITE)
    assert done.removed_files == len(before) == 3 and _files(run) == []
    assert done.messages == (f"SaveMode.OVERWRITE: removed {SUCCESS_MARKER} then 2 other file(s) from {run}",)


@pytest.mark.parametrize("mode", [SaveMode.OVERWRITE, SaveMode.RESUME, SaveMode.ERROR])
def test_a_directory_another_task_owns_is_refused_in_every_mode(tmp_path, mode):
    run = tmp_path / "run"
    before = _earlier_attempt(run, owner=dataclasses.replace(OWNER, dag_id="other_dag", task_id="other"))
    with pytest.raises(
        ForeignRunDirectoryError,
        match=r"belongs to other_dag.other, not dag.infer; two tasks must "
        r"not share a run directory: give this task its own "
        r"stage_location",
    ) as info:
        _prepare(run, mode)
    assert info.value.permanent and _files(run) == before


@pytest.mark.parametrize("mode", [SaveMode.OVERWRITE, SaveMode.RESUME])
def test_files_no_batchinfer_task_wrote_are_never_deleted(tmp_path, mode):
    run = tmp_path / "run"
    run.mkdir()
    (run / "precious.csv").write_text("keep me")
    with pytest.raises(
        ForeignRunDirectoryError,
        match=rf"holds 1 file\(s\) \(precious.csv\) that no batchinfer task "
        rf"wrote \(no {JOB_SPEC_FILE}\); refusing to delete them",
    ):
        _prepare(run, mode)
    assert (run / "precious.csv").read_text() == "keep me"


def test_an_unreadable_claim_is_refused_not_deleted(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / JOB_SPEC_FILE).write_text("{not json")
    with pytest.raises(
        ForeignRunDirectoryError,
        match=rf"a {JOB_SPEC_FILE} that cannot be read .* unknown which task "
        "owns them; nothing was changed",
    ):
        _prepare(run, SaveMode.OVERWRITE)
    # RESUME cannot resume from it either, and then refuses it the same way
    with pytest.raises(ForeignRunDirectoryError, match="cannot be read"):
        _prepare(run, SaveMode.RESUME)
    assert _files(run) == [JOB_SPEC_FILE]


def test_resume_keeps_the_parts_of_the_same_result_and_removes_the_marker_first(tmp_path):
    run = tmp_path / "run"
    before = _earlier_attempt(run, marker=True)
    done = _prepare(run, SaveMode.RESUME, owner=dataclasses.replace(OWNER, try_number=2))
    assert done.resume is True and done.removed_files == 1
    assert _files(run) == [f for f in before if f != SUCCESS_MARKER]
    assert done.messages == (
        f"SaveMode.RESUME: keeping the parts of earlier attempts in {run} (of t01aaaa, which computed the same "
        "result; any other attempt's parts are deleted); only the remaining rows will be scored",
    )
    assert done.kept_attempts == ("t01aaaa",) and done.lineage("t02bbbb") == ("t01aaaa", "t02bbbb")


def test_resume_re_queries_a_materialized_input(tmp_path):
    run = tmp_path / "run"
    _earlier_attempt(run, inputs=(f"{run}/{INPUT_DIR}",))
    (run / INPUT_DIR).mkdir()
    (run / INPUT_DIR / "part-00000.parquet").write_bytes(b"rows")
    # a materialized input is written again by every attempt: its old copy is removed
    done = _prepare(run, SaveMode.RESUME, materialized_input=True)
    assert done.resume and done.removed_files == 1 and not (run / INPUT_DIR).exists()
    assert _files(run) == [JOB_SPEC_FILE, part_name(0, "t01aaaa")]
    assert done.input_digest is None  # not a query (an Iceberg snapshot, pinned as the earlier try did)


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"owner": dataclasses.replace(OWNER, run_id="run0")}, "task and run"),
        ({"owner": dataclasses.replace(OWNER, map_index=3)}, "task and run"),
        ({"result": _result(sha="1" * 64)}, "model_sha256 (the model's sha256)"),
        ({"result": _result(fingerprint=[["/data/other/a.parquet", 100, 1]])}, "input (the input's content: "),
        # the same location rewritten: same name, another size or modification time
        ({"result": _result(fingerprint=[["/data/in/a.parquet", 100, 2]])}, "input (the input's content: "),
        ({"result": _result(fingerprint=[["/data/in/a.parquet", 101, 1]])}, "input (the input's content: "),
        ({"result": _result(input_spec=InputSpec(id_column="id", params={"t": 0.5}))}, "params (InputSpec.params)"),
        ({"result": _result(backend="onnx_int8")}, "engine (the backend or engine: JobSpec.backend"),
        ({"result": _result(engine_kwargs={"dtype": "half"})}, "engine (the backend or engine: "),
        ({"result": _result(input_spec=InputSpec(id_column="ticket_id"))}, "columns (the columns read and how: "),
        ({"result": _result(input_spec=InputSpec(id_column="id", column_mapping={"a": "b"}))}, "columns ("),
        ({"result": _result(input_spec=InputSpec(id_column="id", column_handling={"p": "bytes"}))}, "columns ("),
        ({"result": _result(input_spec=InputSpec(id_column="id", passthrough_columns=("x",)))}, "output_schema ("),
        ({"result": _result(rows_per_part=2000)}, "rows_per_part (the part boundaries: JobSpec.rows_per_part)"),
    ],
)
def test_resume_starts_over_when_the_earlier_attempt_computed_something_else(tmp_path, change, what):
    run = tmp_path / "run"
    _earlier_attempt(run, marker=True)
    done = _prepare(run, SaveMode.RESUME, **change)
    assert done.resume is False and _files(run) == []
    assert done.messages[0].startswith(f"SaveMode.RESUME: the earlier attempt in {run} differs in {what}")
    assert done.messages[0].endswith("; starting over as with OVERWRITE")
    assert done.messages[1].startswith(f"retry clean-up: removed {SUCCESS_MARKER} then 2 other file(s)")


def test_resume_names_every_field_that_differs(tmp_path):
    run = tmp_path / "run"
    _earlier_attempt(run)
    changed = _result(sha="1" * 64, input_spec=InputSpec(id_column="id", params={"t": 1}), backend="onnx")
    message = _prepare(run, SaveMode.RESUME, result=changed).messages[0]
    assert message.startswith(f"SaveMode.RESUME: the earlier attempt in {run} differs in model_sha256 (")
    assert "); params (InputSpec.params); engine (" in message


@pytest.mark.parametrize(
    "execution",
    [
        {"replicas": 4, "num_workers": 2, "num_cpus": 2.0, "memory": 1 << 30},
        {"max_batch_rows": 7, "progress_interval_s": 2.0, "resource_wait_s": 5.0, "in_driver_max_rows": 0},
        {"on_error": "dead_letter", "max_error_fraction": 0.05, "max_cost": 9.5, "max_output_tokens_total": 10},
        {"backend_min_cosine": 0.9},
    ],
)
def test_settings_that_only_decide_how_rows_are_computed_never_block_a_resume(tmp_path, execution):
    run = tmp_path / "run"
    _earlier_attempt(run)
    done = _prepare(run, SaveMode.RESUME, result=_result(**execution))
    assert done.resume is True and part_name(0, "t01aaaa") in _files(run)


def test_a_claim_without_a_result_record_is_never_resumed(tmp_path):
    """An older provider's claim names no result identity: what its parts were scored from is unknown."""
    run = tmp_path / "run"
    claim(Stage.open(str(run)), job_file(run))
    write_part(run, part_name(0, "t01aaaa"), [1, 2])
    done = _prepare(run, SaveMode.RESUME, owner=dataclasses.replace(OWNER, try_number=2))
    assert done.resume is False and _files(run) == []
    assert done.messages[0] == (
        f"SaveMode.RESUME: the earlier attempt in {run} recorded no result identity in its {JOB_SPEC_FILE} (an "
        "older version of the provider wrote it), so what its parts were scored from is unknown; starting over as "
        "with OVERWRITE"
    )


def test_a_record_made_by_another_version_of_the_definition_is_never_resumed(tmp_path):
    run = tmp_path / "run"
    _earlier_attempt(run, result={**_result(), "version": "1"})
    done = _prepare(run, SaveMode.RESUME)
    assert done.resume is False and "differs in version (how the identity is made: " in done.messages[0]


def _query_result(run: Path, texts: list[str], attempt: str) -> None:
    """What the job of ``attempt`` writes when it reads the query: ``_input/<attempt>/``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (run / INPUT_DIR / attempt).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [1, 2], "text": texts}), run / INPUT_DIR / attempt / "part-00000.parquet")


@pytest.mark.parametrize("same", [True, False])
def test_a_resumed_query_keeps_the_parts_only_when_its_result_is_the_same(tmp_path, same):
    """A query is re-run by every attempt's job: its new result (``_input/<attempt>/``) is compared
    with the one the kept parts were scored from (the earlier attempt's, by checksum) once it is read."""
    run = tmp_path / "run"
    _earlier_attempt(run)
    _query_result(run, ["a", "b"], "t01aaaa")
    (run / "_errors").mkdir()
    write_part(run / "_errors", part_name(1, "t01aaaa"), [3])
    done = _prepare(run, SaveMode.RESUME, materialized_input=True, requeried_input=True)
    assert done.resume and done.input_digest is not None and not (run / INPUT_DIR).exists()
    _query_result(run, ["a", "b"] if same else ["a", "B"], "t02bbbb")  # the retry's job reads it again
    messages = confirm_requeried_input(
        Stage.open(str(run)), Stage.open(str(run / INPUT_DIR / "t02bbbb")), done.input_digest
    )
    kept = [f"_errors/{part_name(1, 't01aaaa')}", JOB_SPEC_FILE, f"{INPUT_DIR}/t02bbbb/part-00000.parquet"]
    if same:
        assert _files(run) == sorted([*kept, part_name(0, "t01aaaa")])
        assert messages == (
            f"SaveMode.RESUME: the query's result is the one the kept parts were scored from ({INPUT_DIR}/)",
        )
    else:
        assert _files(run) == sorted([JOB_SPEC_FILE, f"{INPUT_DIR}/t02bbbb/part-00000.parquet"])
        assert messages == (
            f"SaveMode.RESUME: the earlier attempt in {run} differs in input (the input's content: each file's size "
            "and version (ETag or mtime), or a query's text, connection and result): the query's result changed; removed "
            "the 2 file(s) it kept, every row will be scored",
        )


# --- claim, fence ------------------------------------------------------------------------------------------


def test_claim_round_trips_and_a_missing_or_broken_claim_reads_as_such(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    assert read_claim(run) is None
    job = job_file(run.location)
    claim(run, job)
    assert read_claim(run) == job
    run.child(JOB_SPEC_FILE).write_bytes(b'{"format": "batchinfer.job/1"}')
    with pytest.raises(ContractError, match=f"{JOB_SPEC_FILE} has no 'input_spec'"):
        read_claim(run)


def test_the_fence_lets_only_the_claiming_attempt_through(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    with pytest.raises(FencedError, match=rf"its {JOB_SPEC_FILE} is gone .*; not committing"):
        check_fence(run, "t01aaaa")
    claim(run, job_file(run.location, attempt="t02newer", owner=dataclasses.replace(OWNER, try_number=2)))
    assert check_fence(run, "t02newer").attempt == "t02newer"
    with pytest.raises(
        FencedError,
        match=r"attempt t01zombie is no longer the owner .* attempt t02newer \(try 2\) "
        r"took over; not committing",
    ) as info:
        check_fence(run, "t01zombie")
    assert not info.value.permanent
    run.child(JOB_SPEC_FILE).write_bytes(b"garbage")
    with pytest.raises(FencedError, match="cannot tell who owns"):
        check_fence(run, "t02newer")


# --- commit ------------------------------------------------------------------------------------------------


def _claimed_with_parts(tmp_path: Path, attempt: str = "t01aaaa") -> tuple[Stage, tuple[FileEntry, ...]]:
    run = tmp_path / "run"
    stage = Stage.open(str(run))
    claim(stage, job_file(run, attempt=attempt))
    parts = (write_part(run, part_name(0, attempt), [1, 2, 3]), write_part(run, part_name(1, attempt), [4, 5]))
    return stage, parts


def test_commit_writes_the_marker_last_and_readers_get_the_same_manifest(tmp_path):
    stage, parts = _claimed_with_parts(tmp_path)
    errors = (write_part(tmp_path / "run", part_name(0, "t01aaaa", dead_letter=True), [6]),)
    manifest = manifest_for(stage.location, parts, errors)
    commit(stage, manifest)
    assert read_valid_manifest(stage.location, verify_checksums=True) == manifest


def test_a_zombie_cannot_commit_over_a_newer_attempt(tmp_path):
    stage, parts = _claimed_with_parts(tmp_path, attempt="t01zombie")
    claim(stage, job_file(stage.location, attempt="t02newer"))
    with pytest.raises(FencedError, match="attempt t01zombie is no longer the owner"):
        commit(stage, manifest_for(stage.location, parts, attempt="t01zombie"))
    assert not stage.child(SUCCESS_MARKER).exists()


def test_counts_that_do_not_reconcile_commit_nothing(tmp_path):
    stage, parts = _claimed_with_parts(tmp_path)
    with pytest.raises(
        ReconcileError,
        match=r"input_rows 9 != output_rows 5 \+ error_rows 0; nothing was "
        "committed",
    ) as info:
        commit(stage, manifest_for(stage.location, parts, input_rows=9))
    assert not info.value.permanent and not stage.child(SUCCESS_MARKER).exists()
    lying = (dataclasses.replace(parts[0], rows=4), parts[1])
    with pytest.raises(ReconcileError, match="files hold 6 rows but output_rows is 5"):
        commit(stage, dataclasses.replace(manifest_for(stage.location, parts), files=lying))


def test_a_manifest_readers_would_refuse_is_never_written(tmp_path):
    stage, parts = _claimed_with_parts(tmp_path)
    no_checksum = (dataclasses.replace(parts[0], sha256=None), parts[1])
    with pytest.raises(ManifestError, match=r"_SUCCESS.files\[0\] has no 'sha256'"):
        commit(stage, manifest_for(stage.location, no_checksum))
    escaping = (dataclasses.replace(parts[0], name="../elsewhere.parquet"), parts[1])
    with pytest.raises(ManifestError, match="must be a path inside the run directory"):
        commit(stage, manifest_for(stage.location, escaping))
    assert not stage.child(SUCCESS_MARKER).exists()


def test_commit_validates_the_files_it_lists(tmp_path):
    stage, parts = _claimed_with_parts(tmp_path)
    missing = (*parts, dataclasses.replace(parts[1], name=part_name(2, "t01aaaa")))
    with pytest.raises(ManifestError, match="part-00002-t01aaaa.parquet is listed in _SUCCESS but missing"):
        commit(stage, manifest_for(stage.location, missing))
    Path(stage.path, parts[1].name).write_bytes(b"\0" * parts[1].size)  # a torn write of the same size
    with pytest.raises(ManifestError, match="part-00001-t01aaaa.parquet is not a readable Parquet file"):
        commit(stage, manifest_for(stage.location, parts))
    assert not stage.child(SUCCESS_MARKER).exists()
