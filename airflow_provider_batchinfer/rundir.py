"""The run-directory policy: claim, save mode, RESUME eligibility, ownership.

MINIMAL VERSION written by the airflow helper (moved out of the operator's ``_resume_allowed`` /
``_clear_for_resume`` / ``_apply_save_mode``, same messages) so the operator can use the agreed
interface (PLAN.md) before the storage helper's full module (with ``check_fence`` and ``commit``)
lands; the lead keeps the storage helper's module. Imports neither Airflow nor Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from airflow_provider_batchinfer.contract import (
    INPUT_DIR,
    JOB_SPEC_FILE,
    SUCCESS_MARKER,
    ContractError,
    JobFile,
    RunOwner,
)
from airflow_provider_batchinfer.specs import SaveMode
from airflow_provider_batchinfer.stage import Stage, StageError


class RunDirectoryError(StageError):
    """The run directory is in a state this task must not touch. ``permanent``: no retry can fix it."""

    permanent = True


class ForeignRunDirectoryError(RunDirectoryError):
    """Another dag/task owns the directory, or it holds files no batchinfer task wrote."""


class RunDirectoryNotEmptyError(RunDirectoryError):
    """``SaveMode.ERROR`` and a non-empty directory (not this task instance's retry leftovers)."""


class FencedError(RunDirectoryError):
    """Another attempt owns the directory."""

    permanent = False


class ReconcileError(RunDirectoryError):
    """The counts do not add up; nothing was committed."""

    permanent = False


@dataclass(frozen=True)
class Preparation:
    resume: bool
    removed_files: int = 0
    messages: tuple[str, ...] = ()


def read_claim(run_dir: Stage) -> JobFile | None:
    """The ``_job.json`` that claims ``run_dir``; None when there is none; ContractError if unreadable."""
    job_file = run_dir.child(JOB_SPEC_FILE)
    if not job_file.exists():
        return None
    return JobFile.from_json(job_file.read_bytes(), f"{job_file.location}")


def claim(run_dir: Stage, job: JobFile) -> None:
    """Write ``_job.json`` before anything else, so a retry recognizes what this attempt leaves behind."""
    run_dir.child(JOB_SPEC_FILE).write_bytes(job.to_json().encode("utf-8"))


def _claim_or_unreadable(run_dir: Stage) -> JobFile | None | ContractError:
    try:
        return read_claim(run_dir)
    except ContractError as exc:
        return exc


def _resume_differs(recorded: JobFile, owner: RunOwner, model_sha256: str, input_locations: Sequence[str] | None,
                    id_column: str | None) -> list[str]:
    same = {
        "task and run": recorded.airflow.same_task_instance(owner),
        "model sha256": recorded.model.sha256 == model_sha256,
        "input": input_locations is None or list(recorded.input_locations) == list(input_locations),
        "id column": recorded.input_spec.id_column == id_column,
    }
    return [what for what, ok in same.items() if not ok]


def prepare(run_dir: Stage, owner: RunOwner, mode: SaveMode, *, model_sha256: str,
            input_locations: Sequence[str] | None, id_column: str | None, materialized_input: bool) -> Preparation:
    """Apply the save mode before any work starts (see :class:`~airflow_provider_batchinfer.specs.SaveMode`)."""
    messages: list[str] = []
    recorded = _claim_or_unreadable(run_dir)
    if mode is SaveMode.RESUME and isinstance(recorded, JobFile):
        differs = _resume_differs(recorded, owner, model_sha256, input_locations, id_column)
        if not differs:
            marker = run_dir.child(SUCCESS_MARKER)
            if marker.exists():
                marker.delete()
            if materialized_input:
                run_dir.child(INPUT_DIR).delete()
            messages.append(f"SaveMode.RESUME: keeping the parts of earlier attempts in {run_dir.location}; only the "
                            "remaining rows will be scored")
            return Preparation(resume=True, messages=tuple(messages))
        messages.append(f"SaveMode.RESUME: the earlier attempt in {run_dir.location} differs in {', '.join(differs)}; "
                        "starting over as with OVERWRITE")
    removed, more = _apply_save_mode(run_dir, owner, mode, recorded)
    return Preparation(resume=False, removed_files=removed, messages=tuple(messages + more))


def _apply_save_mode(run_dir: Stage, owner: RunOwner, mode: SaveMode,
                     recorded: JobFile | None | ContractError) -> tuple[int, list[str]]:
    files = run_dir.list_files()
    if not files:
        return 0, []
    names = [name for name, _ in files]
    sample = ", ".join(names[:5]) + (" …" if len(names) > 5 else "")
    if isinstance(recorded, ContractError):
        raise ForeignRunDirectoryError(
            f"run directory {run_dir.location} holds a {JOB_SPEC_FILE} this provider cannot read ({recorded}); "
            "refusing to touch it. Give this task its own stage_location / base_stage_location, or remove the "
            "directory yourself"
        )
    if recorded is not None and not recorded.airflow.same_task(owner):
        raise ForeignRunDirectoryError(
            f"run directory {run_dir.location} belongs to {recorded.airflow.dag_id}.{recorded.airflow.task_id}, not "
            f"{owner.dag_id}.{owner.task_id}; two tasks must not share a run directory: give this task its "
            "own stage_location / base_stage_location"
        )
    retry_leftovers = recorded is not None and SUCCESS_MARKER not in names and recorded.airflow.same_task_instance(owner)
    if mode is SaveMode.ERROR and not retry_leftovers:
        raise RunDirectoryNotEmptyError(
            f"run directory {run_dir.location} is not empty ({len(files)} file(s): {sample}) and the save mode is "
            "SaveMode.ERROR; nothing was changed. Use OutputSpec(mode=SaveMode.OVERWRITE) to replace it (retries "
            "and backfill re-runs), or write to another location"
        )
    messages = []
    if retry_leftovers and mode is SaveMode.ERROR and recorded is not None:
        messages.append(f"Removing the uncommitted files of an earlier try (try {recorded.airflow.try_number}) of "
                        "this task and run")
    if recorded is None:
        raise ForeignRunDirectoryError(
            f"run directory {run_dir.location} holds {len(files)} file(s) ({sample}) that no batchinfer task wrote "
            f"(no {JOB_SPEC_FILE}); refusing to delete them with SaveMode.OVERWRITE. Point the task at an empty "
            "location or remove them yourself"
        )
    removed = run_dir.clear_run_directory()
    what = "SaveMode.OVERWRITE" if mode is SaveMode.OVERWRITE else "retry clean-up"
    if SUCCESS_MARKER in names:
        messages.append(f"{what}: removed {SUCCESS_MARKER} then {removed - 1} other file(s) from {run_dir.location}")
    else:
        messages.append(f"{what}: removed {removed} file(s) (no {SUCCESS_MARKER}) from {run_dir.location}")
    return removed, messages
