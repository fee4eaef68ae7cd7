"""The last step of the operator's flow: read what the job committed and turn it into XCom.

The run directory's ``_SUCCESS`` is the only record that counts: it must be valid (schema, files,
footers) and written by this attempt; anything else fails the task with what was found.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, ContractError, Manifest
from airflow_provider_batchinfer.contract.tables import TABLE_MANIFEST_FILE
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.locations import StageError, join

if TYPE_CHECKING:
    from airflow_provider_batchinfer.launchers.base import TaskLog


def read_committed_manifest(location: str, storage_options: dict[str, Any]) -> Manifest:
    """The valid manifest of a run directory whose job just ended; retryable errors otherwise."""
    try:
        manifest = read_valid_manifest(location, storage_options)
    except (ContractError, StageError) as exc:
        raise AirflowException(f"the job ended but its output is not valid: {exc}") from exc
    if manifest is None:
        raise AirflowException(f"the job ended but {location}/{SUCCESS_MARKER} was not written; nothing is committed")
    return manifest


def committed_result(location: str, attempt: str, storage_options: dict[str, Any], log: TaskLog) -> dict[str, Any]:
    """The operator's return value (and XCom keys) from the manifest this attempt committed."""
    manifest = read_committed_manifest(location, storage_options)
    if manifest.job.attempt != attempt:
        raise AirflowException(
            f"{location}/{SUCCESS_MARKER} was written by attempt {manifest.job.attempt}, not this attempt "
            f"({attempt}); another attempt owns the directory"
        )
    counts = manifest.counts
    log.info(
        "Committed %s rows (%s input, %s dead-lettered) in %d file(s) at %s",
        counts.output_rows,
        counts.input_rows,
        counts.error_rows,
        len(manifest.files),
        location,
    )
    table = manifest.table  # a run committed into an Iceberg table
    return {
        **({"table": table.identifier, "snapshot_id": table.snapshot_id, "run_key": table.run_key} if table else {}),
        "output_location": location,
        "manifest_location": join(manifest.run_dir, TABLE_MANIFEST_FILE) if table else join(location, SUCCESS_MARKER),
        "rows": counts.output_rows,
        "input_rows": counts.input_rows,
        "error_rows": counts.error_rows,
        "files": manifest.file_names,
        "error_files": manifest.error_file_names,
        "model": manifest.model.name,
        "model_version": manifest.model.version,
        "sha256": manifest.model.sha256,
        "job_id": manifest.job.id,
        "attempt": attempt,
        **({"usage": manifest.usage.to_dict()} if manifest.usage is not None else {}),
        # incremental scoring: reused_rows, scored_rows, reused_from
        **(manifest.reuse.summary() if manifest.reuse is not None else {}),
    }
