"""The run-directory policy: claim, save mode, RESUME eligibility, ownership, fence and commit.

One module holds the rules of the commit protocol (see ``docs/architecture.md``), so each branch is
unit-tested on a local directory without Ray or Airflow. It imports neither: the operator calls
:func:`prepare` and :func:`claim` before a launch and maps the errors to Airflow's (``permanent``
-> ``AirflowFailException``, else ``AirflowException``); the runtime calls :func:`check_fence`
and :func:`commit`.

- :func:`prepare` runs before any work: RESUME keeps the parts of the earlier attempts of the very
  same result, the ones the claim lists as resumable (``JobFile.resumable``: a lineage of attempts
  whose result identity matched, which a new attempt inherits only when its own matches too);
  otherwise ``SaveMode.ERROR`` refuses a non-empty directory (except the uncommitted
  leftovers of an earlier try of this task instance), ``OVERWRITE`` removes ``_SUCCESS`` first and
  then the rest, and a directory another dag/task owns, or files no batchinfer task wrote, are
  never touched.
- :func:`claim` checks that the store can fence a commit (an S3 store must honour conditional
  writes), revokes every earlier attempt's right to commit, then writes ``_job.json`` naming the
  attempt, before anything else is written.
- :func:`commit` fences (only the attempt ``_job.json`` names may commit: a zombie cannot commit
  over a newer attempt), reconciles the counts, validates the manifest against the files and then
  writes ``_SUCCESS``, last, in one conditional step that fails once the claim moved (``fence``).
"""

from __future__ import annotations

from collections.abc import Mapping

from airflow_provider_batchinfer.contract import (
    JOB_SPEC_FILE,
    SUCCESS_MARKER,
    ContractError,
    JobFile,
    Manifest,
    ManifestError,
    RunOwner,
)
from airflow_provider_batchinfer.contract.specs import SaveMode
from airflow_provider_batchinfer.store.commit.claims import claims_for
from airflow_provider_batchinfer.store.commit.fence import ClaimLost, Hold
from airflow_provider_batchinfer.store.commit.markers import validate_manifest
from airflow_provider_batchinfer.store.commit.rundir_resume import (
    Preparation,
    clear_for_resume,
    confirm_requeried_input,
    resumable,
)
from airflow_provider_batchinfer.store.locations import StageError
from airflow_provider_batchinfer.store.stage import Stage

__all__ = [
    "FencedError",
    "ForeignRunDirectoryError",
    "Preparation",
    "ReconcileError",
    "RunDirectoryError",
    "RunDirectoryNotEmptyError",
    "check_fence",
    "claim",
    "commit",
    "confirm_requeried_input",
    "ensure_held",
    "hold",
    "prepare",
    "read_claim",
]


class RunDirectoryError(StageError):
    """The run directory is in a state this attempt must not touch or commit. ``permanent``: True
    when no retry can fix it (the task should fail without retries), False when a retry can."""

    permanent: bool = False


class ForeignRunDirectoryError(RunDirectoryError):
    """Another dag/task owns the directory, or it holds files no batchinfer task wrote."""

    permanent = True


class RunDirectoryNotEmptyError(RunDirectoryError):
    """``SaveMode.ERROR`` and a non-empty directory that is not this task instance's retry leftovers."""

    permanent = True


class FencedError(RunDirectoryError):
    """Another attempt owns the directory (``_job.json`` names it): this one must not commit."""

    permanent = False


class ReconcileError(RunDirectoryError):
    """The counts do not add up (input != output + dead-lettered); nothing was committed."""

    permanent = False


# --- the claim and the fence -----------------------------------------------------------------------


def require_fenced_store(run_dir: Stage, who: str) -> None:
    """ConditionalWritesUnsupported (permanent) when ``run_dir``'s store cannot fence a commit.

    Asked before :func:`prepare`, whose save mode may delete an earlier run's files: on a store
    that ignores or rejects conditional writes no attempt can commit, so nothing there is changed
    either. The answer is kept per process and bucket, so the claim's own check costs nothing."""
    claims_for(run_dir).require_conditional_writes(
        who, f"not preparing {run_dir.location}; nothing in it was changed and no job was started"
    )


def claim(run_dir: Stage, job: JobFile) -> None:
    """Take the directory for ``job``'s attempt: call it before anything else is written into it,
    so a retry recognizes whatever this attempt leaves behind as its own.

    First the store is asked whether it can fence this attempt's commit: on an S3 store that ignores
    or rejects conditional writes the commit would be refused, so the claim is refused now
    (``fence.ConditionalWritesUnsupported``, permanent), before anything is changed or any work
    starts. A table's claim directory is not asked: its rows commit as an Iceberg snapshot, fenced
    through the catalog (``runtime/output/table_commit.py``), with no marker in the directory. Then earlier
    attempts lose the right to commit (their tokens are revoked: ``fence``), so none can commit from
    here on; then a marker one of them committed after :func:`prepare` ran is removed (prepare
    leaves none in any mode, and a stale marker must never sit beside new parts); then
    ``_job.json`` is written and this attempt gets its token."""
    store = claims_for(run_dir)
    if job.table_output is None:
        store.require_conditional_writes(
            job.attempt, f"not claiming {run_dir.location} for attempt {job.attempt}; no job was started"
        )
    store.revoke()
    marker = run_dir.child(SUCCESS_MARKER)
    if marker.exists():
        marker.delete()
    run_dir.child(JOB_SPEC_FILE).write_bytes(job.to_json().encode("utf-8"))
    store.grant(job.attempt)


def read_claim(run_dir: Stage) -> JobFile | None:
    """The job file that claims the directory; None when there is none. Raises ContractError when
    it cannot be read as a job file."""
    job_file = run_dir.child(JOB_SPEC_FILE)
    if not job_file.exists():
        return None
    return JobFile.from_json(job_file.read_bytes(), job_file.location)


def check_fence(run_dir: Stage, attempt: str) -> JobFile:
    """The claim, when it names ``attempt``; else FencedError: a newer attempt took the directory
    over (or cleared it), and this one is a zombie that must not write or commit."""
    return hold(run_dir, attempt).job


def hold(run_dir: Stage, attempt: str) -> Hold:
    """``attempt``'s hold on the claim, as read now: what a conditional commit is made against.
    FencedError when the claim names another attempt, is gone or unreadable, or when the token
    the claim granted is gone (revoked by a newer claim; or the directory was claimed by a version
    of the provider that granted none: a retry of the task claims it again)."""
    store = claims_for(run_dir)
    try:
        read = store.read()
        job = None if read is None else JobFile.from_json(read[0], store.job_file.location)
    except ContractError as exc:
        raise FencedError(
            f"attempt {attempt} cannot tell who owns {run_dir.location}: {exc}; not committing. "
            "A retry of the task writes a new claim"
        ) from exc
    if job is None or read is None:
        raise FencedError(
            f"attempt {attempt} is no longer the owner of {run_dir.location}: its {JOB_SPEC_FILE} "
            "is gone (a newer attempt cleared the directory); not committing"
        )
    if job.attempt != attempt:
        raise FencedError(_taken_over(run_dir, attempt, job))
    if not store.granted(attempt):
        raise FencedError(
            f"attempt {attempt} holds no commit token in {run_dir.location} (a newer claim revoked it, or the "
            "directory was claimed without one); not committing. A retry of the task claims it again"
        )
    return Hold(job, store.token(attempt, read[1]))


def ensure_held(run_dir: Stage, held: Hold) -> None:
    """FencedError unless ``held`` still holds the claim (its token is unchanged)."""
    if not claims_for(run_dir).held(held):
        raise _lost(run_dir, held.attempt, "its claim changed")


def _taken_over(run_dir: Stage, attempt: str, job: JobFile) -> str:
    return (
        f"attempt {attempt} is no longer the owner of {run_dir.location}: attempt {job.attempt} "
        f"(try {job.airflow.try_number}) took over; not committing"
    )


def _lost(run_dir: Stage, attempt: str, why: str) -> FencedError:
    """The FencedError of an attempt whose conditional step failed, naming the claim's owner now."""
    try:
        now = read_claim(run_dir)
    except (ContractError, StageError):
        now = None
    if now is not None and now.attempt != attempt:
        return FencedError(f"{_taken_over(run_dir, attempt, now)} ({why})")
    return FencedError(
        f"attempt {attempt} is no longer the owner of {run_dir.location}: {why} (a newer attempt claimed or "
        "cleared the directory); not committing"
    )


def commit(run_dir: Stage, manifest: Manifest) -> None:
    """The commit: hold the claim for the manifest's attempt, reconcile the counts, check the
    manifest's schema (as every reader will read it) and the files it lists (names, sizes, Parquet
    footers), then write ``_SUCCESS`` last, conditioned on the hold: the write fails, and nothing is
    committed, once a newer attempt claimed or cleared the directory, however long this process was
    stopped in between (``fence``). Checksums are not re-computed: the writer computed them."""
    where = f"{run_dir.location}/{SUCCESS_MARKER}"
    held = hold(run_dir, manifest.job.attempt)
    try:
        manifest.check_counts(where)
    except ManifestError as exc:
        raise ReconcileError(
            f"{exc}; nothing was committed. Rows were lost or counted twice: a retry re-runs the job"
        ) from exc
    Manifest.from_dict(manifest.to_dict(), where)  # one schema: what readers accept is what is written
    validate_manifest(run_dir, manifest)
    try:
        claims_for(run_dir).write_marker(held, manifest.to_json().encode("utf-8"))
    except ClaimLost as exc:
        raise _lost(run_dir, held.attempt, str(exc)) from exc


# --- prepare: RESUME or the save mode ----------------------------------------------------------------


def prepare(
    run_dir: Stage,
    owner: RunOwner,
    mode: SaveMode,
    *,
    result: Mapping[str, str],
    materialized_input: bool,
    requeried_input: bool = False,
) -> Preparation:
    """Make the run directory ready for a new attempt of ``owner``, before any work starts.

    ``SaveMode.RESUME`` keeps earlier parts only when they were written for this very result: the
    same task instance and the same result identity (``result``, ``identity.result_identity``),
    compared field by field with the one the claim records; otherwise the directory is handled as
    with OVERWRITE and the log names what differed. Only the parts of the attempts the claim lists
    as resumable are kept (:attr:`Preparation.kept_attempts`; the new attempt's claim lists them
    and itself: :meth:`Preparation.lineage`), so a late part of an attempt of another result (a
    zombie's) is never kept. ``materialized_input``: the input is
    materialized under ``_input/`` by each attempt (removed here); ``requeried_input``: it is a
    query whose result may have changed, so its old result's digest is kept for
    :func:`confirm_requeried_input`. Raises ForeignRunDirectoryError or RunDirectoryNotEmptyError
    (both permanent) and changes nothing then.
    """
    messages: list[str] = []
    recorded = _resumable_claim(run_dir, owner, result, messages) if mode is SaveMode.RESUME else None
    if recorded is not None:
        return clear_for_resume(run_dir, recorded, materialized_input, requeried_input, messages)
    return _apply_save_mode(run_dir, owner, mode, messages)


def _resumable_claim(run_dir: Stage, owner: RunOwner, result: Mapping[str, str], messages: list[str]) -> JobFile | None:
    """The claim, when its attempt computed this very result; else None, and the reason is logged."""
    try:
        recorded = read_claim(run_dir)
    except ContractError:
        return None
    return None if recorded is None else resumable(run_dir, recorded, owner, result, messages)


def _recorded_owner(run_dir: Stage, sample: str, count: int) -> RunOwner | None:
    """Who claims the directory: None when there is no ``_job.json``; an unreadable one is refused."""
    try:
        job = read_claim(run_dir)
    except ContractError as exc:
        raise ForeignRunDirectoryError(
            f"run directory {run_dir.location} holds {count} file(s) ({sample}) and a {JOB_SPEC_FILE} that cannot "
            f"be read ({exc}), so it is unknown which task owns them; nothing was changed. Point the task at "
            "an empty location or remove them yourself"
        ) from exc
    return None if job is None else job.airflow


def _apply_save_mode(run_dir: Stage, owner: RunOwner, mode: SaveMode, messages: list[str]) -> Preparation:
    files = run_dir.list_files()
    if not files:
        return Preparation(resume=False, removed_files=0, messages=tuple(messages))
    names = [name for name, _ in files]
    sample = ", ".join(names[:5]) + (" …" if len(names) > 5 else "")
    recorded = _recorded_owner(run_dir, sample, len(files))
    if recorded is not None and not recorded.same_task(owner):
        raise ForeignRunDirectoryError(
            f"run directory {run_dir.location} belongs to {recorded.dag_id}.{recorded.task_id}, not "
            f"{owner.dag_id}.{owner.task_id}; two tasks must not share a run directory: give this task its "
            "own stage_location / base_stage_location"
        )
    retry_leftovers = (
        recorded is not None
        and SUCCESS_MARKER not in names
        and (recorded.run_id, recorded.map_index) == (owner.run_id, owner.map_index)
    )
    if mode is SaveMode.ERROR and not retry_leftovers:
        raise RunDirectoryNotEmptyError(
            f"run directory {run_dir.location} is not empty ({len(files)} file(s): {sample}) and the save mode is "
            "SaveMode.ERROR; nothing was changed. Use OutputSpec(mode=SaveMode.OVERWRITE) to replace it (retries "
            "and backfill re-runs), or write to another location"
        )
    if recorded is None:
        raise ForeignRunDirectoryError(
            f"run directory {run_dir.location} holds {len(files)} file(s) ({sample}) that no batchinfer task wrote "
            f"(no {JOB_SPEC_FILE}); refusing to delete them with SaveMode.OVERWRITE. Point the task at an empty "
            "location or remove them yourself"
        )
    if retry_leftovers and mode is SaveMode.ERROR:
        messages.append(
            f"Removing the uncommitted files of an earlier try (try {recorded.try_number}) of this task and run"
        )
    removed = clear_run_directory(run_dir)
    what = "SaveMode.OVERWRITE" if mode is SaveMode.OVERWRITE else "retry clean-up"
    if SUCCESS_MARKER in names:
        messages.append(f"{what}: removed {SUCCESS_MARKER} then {removed - 1} other file(s) from {run_dir.location}")
    else:
        messages.append(f"{what}: removed {removed} file(s) (no {SUCCESS_MARKER}) from {run_dir.location}")
    return Preparation(resume=False, removed_files=removed, messages=tuple(messages))


def clear_run_directory(run_dir: Stage) -> int:
    """Empty a run directory for OVERWRITE: the claim is revoked first, so no earlier attempt
    can commit from then on (``fence``; one that committed before is removed next); then
    ``_SUCCESS``, so a reader never sees an old marker beside new parts; then every other file.
    Returns how many files were removed.

    On S3 pyarrow lists ``<key>/`` (so ``run1`` never touches ``run10/``) and deletes in
    DeleteObjects batches of up to 1,000 keys; nothing relies on a rename."""
    removed = len(run_dir.list_files())
    claims_for(run_dir).revoke()
    marker = run_dir.child(SUCCESS_MARKER)
    if marker.exists():
        marker.delete()
    run_dir.delete_contents()
    return removed
