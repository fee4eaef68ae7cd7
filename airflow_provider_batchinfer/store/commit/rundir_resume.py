"""What ``SaveMode.RESUME`` keeps of the earlier attempts in a run directory: the half of
``rundir.prepare`` that decides whether the claim's attempt computed this very result, and which
attempts' parts (and which query result) a new attempt inherits.

A part is kept only when the claim names the same task instance and the same result identity
(``identity.result_identity``, compared field by field), and only the parts of the attempts the
claim lists as resumable (``JobFile.resumable``), so a late part of an attempt of another result
(a zombie's) is never kept. A query input can change between attempts: the digest of the result
the kept parts were scored from travels in the claim, and :func:`confirm_requeried_input` drops
every kept part when the re-run query returns another. Storage layer: imports neither Airflow nor
Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from airflow_provider_batchinfer.contract import (
    INPUT_DIR,
    JOB_SPEC_FILE,
    SUCCESS_MARKER,
    JobFile,
    RunOwner,
    attempt_of,
)
from airflow_provider_batchinfer.store.identity import describe_fields, materialized_digest, result_differences
from airflow_provider_batchinfer.store.stage import Stage

__all__ = ["Preparation", "clear_for_resume", "confirm_requeried_input", "resumable"]


@dataclass(frozen=True)
class Preparation:
    """What ``rundir.prepare`` did. ``resume``: RESUME keeps the earlier parts (the marker is already
    removed). ``messages``: what was done, for the task log. ``input_digest``: for a kept query
    input, the digest of the result the kept parts were scored from (see
    :func:`confirm_requeried_input`); None otherwise. ``kept_attempts``: the earlier attempts
    whose parts are kept, oldest first (the runtime deletes every other attempt's)."""

    resume: bool
    removed_files: int
    messages: tuple[str, ...] = ()
    input_digest: str | None = None
    kept_attempts: tuple[str, ...] = ()

    def lineage(self, attempt: str) -> tuple[str, ...]:
        """What the new attempt's claim lists as resumable (``JobFile.resumable``): the earlier
        attempts whose parts are kept, then ``attempt``; only ``attempt`` when nothing is kept."""
        return (*self.kept_attempts, attempt) if self.resume else (attempt,)


def resumable(
    run_dir: Stage, recorded: JobFile, owner: RunOwner, result: Mapping[str, str], messages: list[str]
) -> JobFile | None:
    """``recorded`` (the claim), when its attempt computed this very result for ``owner``'s task
    instance; else None, and the reason is logged in ``messages``."""
    where = f"SaveMode.RESUME: the earlier attempt in {run_dir.location}"
    if not recorded.airflow.same_task_instance(owner):
        differs = ["task and run"]
    elif recorded.result is None:
        messages.append(
            f"{where} recorded no result identity in its {JOB_SPEC_FILE} (an older version of the provider wrote "
            "it), so what its parts were scored from is unknown; starting over as with OVERWRITE"
        )
        return None
    else:
        differs = result_differences(recorded.result, result)
    if differs:
        messages.append(f"{where} differs in {describe_fields(differs)}; starting over as with OVERWRITE")
        return None
    return recorded


def clear_for_resume(
    run_dir: Stage, recorded: JobFile, materialized_input: bool, requeried_input: bool, messages: list[str]
) -> Preparation:
    """Keep the parts of the attempts the claim lists as resumable (the runtime deletes any other
    attempt's, and decides which are complete); remove the marker first, so a stale one never sits
    beside new parts, and a materialized input, which is written again (for a query, after finding
    the digest of the result the kept parts came from: :func:`_kept_result`)."""
    removed = 0
    marker = run_dir.child(SUCCESS_MARKER)
    if marker.exists():
        marker.delete()
        removed += 1
    digest = None
    lineage = recorded.resumable_attempts
    if materialized_input:
        inputs = run_dir.child(INPUT_DIR)
        if requeried_input:
            digest, lineage = _kept_result(run_dir, recorded, messages)
        removed += len(inputs.list_files())
        inputs.delete()
    messages.append(
        f"SaveMode.RESUME: keeping the parts of earlier attempts in {run_dir.location} (of {', '.join(lineage)}, "
        "which computed the same result; any other attempt's parts are deleted); only the remaining rows will be "
        "scored"
    )
    return Preparation(
        resume=True, removed_files=removed, messages=tuple(messages), input_digest=digest, kept_attempts=lineage
    )


def _kept_result(run_dir: Stage, recorded: JobFile, messages: list[str]) -> tuple[str, tuple[str, ...]]:
    """For a query input: the digest of the result the kept parts were scored from, and the
    attempts whose parts are kept.

    The claim carries that digest (``SqlInput.kept_digest``) from one resumed attempt to the next.
    Its attempt's own ``_input/<attempt>/`` is digested only where it is known to be what the kept
    parts came from: when the attempt started afresh (every part it kept is its own), or when it
    wrote parts (it writes them only after its whole result was read and compared with the claim's
    digest: :func:`confirm_requeried_input`). An attempt killed while it re-ran the query, or
    before it compared the result, leaves an ``_input/`` no kept part was scored from: the claim's
    digest stands. When the attempt found the result changed, it removed the parts it had kept
    and scored from the new result: only its own parts are kept from then on."""
    own = recorded.attempt
    lineage = recorded.resumable_attempts
    before = recorded.sql_input.kept_digest if recorded.sql_input is not None else None
    if before is not None and not _wrote_parts(run_dir, own):
        return before, lineage
    digest = materialized_digest(run_dir.child(INPUT_DIR, own))
    if before is not None and digest != before:
        messages.append(
            f"SaveMode.RESUME: attempt {own} in {run_dir.location} found the query's result changed and scored "
            "from the new one; only its own parts are kept"
        )
        return digest, (own,)
    return digest, lineage


def _wrote_parts(run_dir: Stage, attempt: str) -> bool:
    return any(attempt_of(name) == attempt for name, _ in run_dir.list_files())


def confirm_requeried_input(run_dir: Stage, inputs: Stage, before: str) -> tuple[str, ...]:
    """After a resumed attempt re-ran its query into ``inputs`` (its ``_input/<attempt>/``): when
    the result differs from the one the kept parts were scored from (``before``,
    :attr:`Preparation.input_digest`), remove every kept part (all but ``_job.json`` and
    ``_input/``) so that every row is scored from the new result. The job calls it
    (``runtime/inputs/sql_input.py``) before it looks at the kept parts. Returns what was done, for the log."""
    if materialized_digest(inputs) == before:
        return (f"SaveMode.RESUME: the query's result is the one the kept parts were scored from ({INPUT_DIR}/)",)
    kept = [n for n, _ in run_dir.list_files() if n != JOB_SPEC_FILE and not n.startswith(INPUT_DIR + "/")]
    for name in kept:
        run_dir.child(*name.split("/")).delete()
    return (
        f"SaveMode.RESUME: the earlier attempt in {run_dir.location} differs in {describe_fields(['input'])}: the "
        f"query's result changed; removed the {len(kept)} file(s) it kept, every row will be scored",
    )
