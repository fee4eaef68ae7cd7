"""What decides a run's rows (its *result identity*) and a job's identity, defined once.

**The result identity** names every field that decides a run's rows, each recorded as its own
digest in ``_job.json`` (``JobFile.result``), so a retry can tell which one changed
(:data:`RESULT_FIELDS`): the input's content (Parquet: every file with its size and version, from
one listing per location, the version being the object's ETag on S3 and the modification time in
nanoseconds elsewhere; SQL: the
query text and its connection, the materialized result being compared by checksum once it is
re-run; Iceberg: the input URI, whose snapshot a retry pins as the earlier try did), the model
sha256, ``InputSpec.params``, the backend and engine, the columns read with their mapping and
handling, the passthrough columns and output schema, and ``JobSpec.rows_per_part`` (part
boundaries). ``SaveMode.RESUME`` keeps the parts of an earlier attempt only when every field is the
same (``rundir.prepare``); settings that only decide how the rows are computed (replicas, CPUs,
timeouts, batch sizes, budgets) are not in it and never block a resume.

**The job identity** digests the task instance, the result identity and the execution settings
(the whole InputSpec and JobSpec, save mode, run directory): a retry whose worker died must not
throw away a job that is still running and still computing the right thing, and a retry after any
of these changed must not re-attach to a job computing the old thing (``JobFile.identity``). The
task instance is dag, task, run and map index (:func:`task_key`), as the ``common.ai`` provider's
``LLMBatchOperator`` keys its batches (``compute_identity_key`` without the try).

From Airflow 3.3's ``ResumableJobMixin`` we take the decision table (a recorded job still running:
re-attach; in a terminal state: submit anew) but close its documented gap between submit and
record: the submission id is chosen and written to ``_job.json`` *before* the job is submitted, so
a crash right after the submit leaves a claim that names a job the cluster knows.

Imports neither Airflow nor Ray: the operator computes both identities, launchers and
``rundir.prepare`` only compare them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract.placement import LLM_FLAVOR, chosen_engine
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract import RunOwner
    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, SaveMode

#: bumped when what goes into either identity changes (an old claim then never matches: a fresh job,
#: and RESUME starts over)
IDENTITY_VERSION = 2

#: The fields of the result identity, in the order a mismatch names them, with what each covers.
RESULT_FIELDS: dict[str, str] = {
    "input": "the input's content: each file's size and version (ETag or mtime), or a query's text, connection and result",
    "model_sha256": "the model's sha256",
    "params": "InputSpec.params",
    "engine": "the backend or engine: JobSpec.backend, engine, engine_kwargs and the connection's llm_engine",
    "columns": "the columns read and how: InputSpec.columns, column_mapping, column_handling, id_column",
    "output_schema": "the output schema: InputSpec.passthrough_columns and the model's output signature",
    "rows_per_part": "the part boundaries: JobSpec.rows_per_part",
}


def task_key(owner: RunOwner) -> str:
    """128 bits naming the task instance (dag, task, run, map index): the same for every try."""
    text = "\x00".join((owner.dag_id, owner.task_id, owner.run_id, str(owner.map_index)))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _is_input_file(rel: str) -> bool:
    """The files ``inputs.list_input_files`` reads: Parquet, no hidden or ``_``-prefixed part."""
    return rel.endswith((".parquet", ".pq")) and not any(p.startswith(("_", ".")) for p in rel.split("/"))


def _s3_fingerprint(location: str, stage: Stage) -> list[list[Any]]:
    """``[location, size, ETag]`` of the Parquet objects at an ``s3://`` location, from its listing."""
    from airflow_provider_batchinfer.store import s3_objects

    return [
        [stage.child(*rel.split("/")).location if rel else location, size, etag]
        for rel, size, etag in s3_objects.list_versions(stage)
        if rel == "" or _is_input_file(rel)
    ]


def parquet_fingerprint(locations: Sequence[str], storage_options: dict[str, Any] | None) -> list[list[Any]]:
    """``[location, size, version]`` for every Parquet file the input locations hold, from one
    listing per location: the version is the ETag on S3 (which lists it with the name, and which
    names the content) and the modification time in nanoseconds elsewhere. The files are those
    ``inputs.list_input_files`` reads: hidden and ``_``-prefixed names are skipped."""
    import pyarrow.fs as pafs

    entries: list[list[Any]] = []
    for location in locations:
        stage = Stage.open(location, storage_options)
        if location.split("://", 1)[0].lower() in ("s3", "s3a"):
            entries.extend(_s3_fingerprint(location, stage))
            continue
        with stage._io("list"):
            info = stage.fs.get_file_info(stage.path)
            if info.type == pafs.FileType.File:
                entries.append([location, info.size, info.mtime_ns])
                continue
            items = stage.fs.get_file_info(pafs.FileSelector(stage.path, recursive=True, allow_not_found=True))
        prefix = stage.path.rstrip("/") + "/"
        for item in items:
            rel = item.path[len(prefix) :] if item.path.startswith(prefix) else item.path
            if item.type == pafs.FileType.File and _is_input_file(rel):
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


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def result_identity(
    *,
    input_fingerprint: Any,
    model_sha256: str,
    input_spec: InputSpec,
    job_spec: JobSpec,
    model_flavor: str | None = None,
    model_signature: Mapping[str, Any] | None = None,
    connection_engine: str | None = None,
) -> dict[str, str]:
    """What decides the run's rows, as ``{field: sha256 hex}`` for every field of
    :data:`RESULT_FIELDS` plus ``version`` (:data:`IDENTITY_VERSION`). ``input_fingerprint``:
    :func:`input_fingerprint`. ``connection_engine``: the connection's ``llm_engine``, which picks a
    text generation model's engine when ``JobSpec.engine`` does not."""
    llm = model_flavor == LLM_FLAVOR
    values: dict[str, Any] = {
        "input": input_fingerprint,
        "model_sha256": model_sha256,
        "params": input_spec.params,
        "engine": {
            "backend": job_spec.backend,
            "engine": chosen_engine(job_spec.engine, connection_engine, job_spec.num_gpus) if llm else job_spec.engine,
            "engine_kwargs": job_spec.engine_kwargs,
        },
        "columns": {
            "columns": input_spec.columns,
            "column_mapping": input_spec.column_mapping,
            "column_handling": input_spec.column_handling,
            "id_column": input_spec.id_column,
        },
        "output_schema": {
            "passthrough_columns": input_spec.passthrough_columns,
            "outputs": (model_signature or {}).get("outputs"),
        },
        "rows_per_part": job_spec.rows_per_part,
    }
    return {"version": str(IDENTITY_VERSION), **{name: _digest(values[name]) for name in RESULT_FIELDS}}


def result_differences(recorded: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """The fields of :data:`RESULT_FIELDS` whose digests differ, in that order; ``["version"]``
    when ``recorded`` was made by another version of the definition (its digests are not comparable)."""
    if recorded.get("version") != current.get("version"):
        return ["version"]
    return [name for name in RESULT_FIELDS if recorded.get(name) != current.get(name)]


def describe_fields(names: Sequence[str]) -> str:
    """The fields named for a log line: ``input (the input's content: ...); params (InputSpec.params)``."""
    known = {**RESULT_FIELDS, "version": "how the identity is made: another version of the provider"}
    return "; ".join(f"{name} ({known[name]})" if name in known else name for name in names)


def materialized_digest(directory: Stage) -> str:
    """The sha256 over a materialized input's files (name and sha256 of each), read in 1 MiB
    chunks; the digest of no files when the directory is absent. A re-run query is compared by it."""
    outer = hashlib.sha256()
    for name, _size in directory.list_files():
        inner = hashlib.sha256()
        with directory._io("read"), directory.fs.open_input_stream(directory.child(*name.split("/")).path) as f:
            while chunk := f.read(1 << 20):
                inner.update(chunk)
        outer.update(f"{name}\x00{inner.hexdigest()}\n".encode())
    return outer.hexdigest()


def job_identity(
    owner: RunOwner,
    *,
    run_dir: str,
    result: Mapping[str, str],
    model: str,
    input_spec: InputSpec,
    job_spec: JobSpec,
    save_mode: SaveMode,
) -> str:
    """The job's identity: a sha256 hex digest (256 bits) of the task instance, the result identity
    (:func:`result_identity`) and the execution settings."""
    return _digest(
        {
            "version": IDENTITY_VERSION,
            "task": task_key(owner),
            "run_dir": run_dir,
            "result": dict(result),
            "model": model,
            "input_spec": input_spec.to_dict(),
            "job_spec": job_spec.to_dict(),
            "save_mode": save_mode.name,
        }
    )
