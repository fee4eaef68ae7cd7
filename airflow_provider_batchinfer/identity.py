"""A job's identity: the task instance plus what it computes, never the try.

A retry whose worker died must not throw away a job that is still running and still computing the
right thing; a retry after the input or the model changed must not re-attach to a job computing
the old thing. So the identity digests both halves (``JobFile.identity``):

- **the task instance**: dag, task, run and map index (:func:`task_key`), as the ``common.ai``
  provider's ``LLMBatchOperator`` keys its batches (``compute_identity_key`` without the try);
- **what it computes** (its *fingerprint*, as that operator calls it): the input (Parquet: every
  file with its size and modification time, from one listing per location; SQL: the query text and
  its connection id), the model version and sha256, the InputSpec and JobSpec, the save mode and
  the run directory.

From Airflow 3.3's ``ResumableJobMixin`` we take the decision table (a recorded job still running:
re-attach; in a terminal state: submit anew) but close its documented gap between submit and
record: the submission id is chosen and written to ``_job.json`` *before* the job is submitted, so
a crash right after the submit leaves a claim that names a job the cluster knows.

Imports neither Airflow nor Ray: the operator computes the identity, launchers only compare it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.stage import Stage

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract import RunOwner
    from airflow_provider_batchinfer.specs import InputSpec, JobSpec, SaveMode

#: bumped when what goes into the digest changes (an old claim then never matches: a fresh job)
IDENTITY_VERSION = 1


def task_key(owner: RunOwner) -> str:
    """128 bits naming the task instance (dag, task, run, map index): the same for every try."""
    text = "\x00".join((owner.dag_id, owner.task_id, owner.run_id, str(owner.map_index)))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def parquet_fingerprint(locations: Sequence[str], storage_options: dict[str, Any] | None) -> list[list[Any]]:
    """``[location, size, mtime_ns]`` for every Parquet file the input locations hold, from one
    listing per location (S3 lists sizes and modification times with the names). The files are
    those ``inputs.list_input_files`` reads: hidden and ``_``-prefixed names are skipped."""
    import pyarrow.fs as pafs

    entries: list[list[Any]] = []
    for location in locations:
        stage = Stage.open(location, storage_options)
        with stage._io("list"):
            info = stage.fs.get_file_info(stage.path)
            if info.type == pafs.FileType.File:
                entries.append([location, info.size, info.mtime_ns])
                continue
            items = stage.fs.get_file_info(pafs.FileSelector(stage.path, recursive=True, allow_not_found=True))
        prefix = stage.path.rstrip("/") + "/"
        for item in items:
            rel = item.path[len(prefix) :] if item.path.startswith(prefix) else item.path
            if item.type != pafs.FileType.File or any(p.startswith(("_", ".")) for p in rel.split("/")):
                continue
            if rel.endswith((".parquet", ".pq")):
                entries.append([stage.child(*rel.split("/")).location, item.size, item.mtime_ns])
    return sorted(entries)


def sql_fingerprint(sql: str, conn_id: str | None) -> dict[str, Any]:
    """A query's identity is its text and where it runs (its result is materialized by the job)."""
    return {"sql": sql, "conn_id": conn_id}


def input_fingerprint(
    locations: Sequence[str] | None, sql: str | None, conn_id: str | None, storage_options: dict[str, Any] | None
) -> Any:
    """The Parquet input's files (``locations``) or, for a query (``locations`` None), its text."""
    if locations is None:
        return sql_fingerprint(sql or "", conn_id)
    return parquet_fingerprint(locations, storage_options)


def job_identity(
    owner: RunOwner,
    *,
    run_dir: str,
    input_fingerprint: Any,
    model_sha256: str,
    model: str,
    input_spec: InputSpec,
    job_spec: JobSpec,
    save_mode: SaveMode,
) -> str:
    """The job's identity: a sha256 hex digest (256 bits) of the task instance and of what it
    computes. ``input_fingerprint``: :func:`parquet_fingerprint` or :func:`sql_fingerprint`."""
    material = {
        "version": IDENTITY_VERSION,
        "task": task_key(owner),
        "run_dir": run_dir,
        "input": input_fingerprint,
        "model": model,
        "model_sha256": model_sha256,
        "input_spec": input_spec.to_dict(),
        "job_spec": job_spec.to_dict(),
        "save_mode": save_mode.name,
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
