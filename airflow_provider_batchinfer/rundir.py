"""The run-directory policy in the storage layer (minimal stand-in: the fence and the commit).

Owner: the storage helper, whose full module (``prepare``, ``claim``, ``read_claim`` and the
save-mode policy) replaces this one; the signatures here are the agreed ones (PLAN.md). Imports
neither Airflow nor Ray.
"""

from __future__ import annotations

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, JobFile, Manifest, ManifestError
from airflow_provider_batchinfer.stage import Stage, StageError


class RunDirectoryError(StageError):
    """A run directory is in a state this attempt must not touch. ``permanent``: no retry can fix it."""

    permanent: bool = True


class FencedError(RunDirectoryError):
    """Another attempt owns the run directory (its ``_job.json`` names it); this one must not commit."""

    permanent = False


class ReconcileError(RunDirectoryError):
    """The counts do not add up (input rows != output + dead-lettered, or files vs counts); nothing
    was committed."""

    permanent = False


def check_fence(run_dir: Stage, attempt: str) -> JobFile:
    """The claim in ``run_dir`` when it names ``attempt``; FencedError when another attempt took over
    (this one is a zombie) or the claim is gone."""
    claim = run_dir.child(JOB_SPEC_FILE)
    try:
        job = JobFile.from_json(claim.read_bytes(), where=claim.location)
    except FileNotFoundError as exc:
        raise FencedError(f"attempt {attempt} no longer owns {run_dir.location}: its {JOB_SPEC_FILE} is gone "
                          "(the directory was cleared by another try); not committing") from exc
    if job.attempt != attempt:
        raise FencedError(
            f"attempt {attempt} is no longer the owner of {run_dir.location}: attempt {job.attempt} "
            f"(try {job.airflow.try_number}) took over; not committing"
        )
    return job


def commit(run_dir: Stage, manifest: Manifest) -> None:
    """The commit: fence on the manifest's attempt, check that the counts reconcile and that every
    listed file is there with its recorded size, then write ``_SUCCESS`` last."""
    check_fence(run_dir, manifest.job.attempt)
    marker = f"{run_dir.location}/{SUCCESS_MARKER}"
    try:
        manifest.check_counts(marker)
    except ManifestError as exc:
        raise ReconcileError(f"{exc}; not committing") from exc
    present = dict(run_dir.list_files())
    for entry in (*manifest.files, *manifest.error_files):
        if entry.name not in present:
            raise ReconcileError(f"{run_dir.location}/{entry.name} is listed in the manifest but missing; "
                                 "not committing")
        if present[entry.name] != entry.size:
            raise ReconcileError(f"{run_dir.location}/{entry.name} is {present[entry.name]} bytes but the manifest "
                                 f"says {entry.size}; not committing")
    run_dir.child(SUCCESS_MARKER).write_bytes(manifest.to_json().encode("utf-8"))
