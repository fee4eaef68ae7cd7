"""Run directories as the runtime leaves them, for the storage tests: real Parquet parts with their
sha256, a typed :class:`Manifest` and a typed :class:`JobFile` (no hand-built dicts)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from airflow_provider_batchinfer.contract import (
    Counts,
    FileEntry,
    JobFile,
    JobRecord,
    Manifest,
    ModelRef,
    RunOwner,
    part_name,
)
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec

MODEL = ModelRef(name="m", version="v1", flavor="python_class", sha256="0" * 64, uri="/registry/m/v1")
OWNER = RunOwner(dag_id="dag", task_id="infer", run_id="run1", try_number=1)


def parquet_bytes(ids: list[int], scores: list[float] | None = None) -> bytes:
    """A small Parquet file: ``id`` (int64) and ``score`` (float, ``id`` unless given)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    scores = [float(i) for i in ids] if scores is None else scores
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "score": pa.array(scores, pa.float64())}), sink)
    return sink.getvalue()


def write_part(run_dir: Path, name: str, ids: list[int]) -> FileEntry:
    """One real Parquet part and its manifest entry (size, rows, sha256 of the bytes written)."""
    data = parquet_bytes(ids)
    path = run_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return FileEntry(name=name, size=len(data), rows=len(ids), sha256=hashlib.sha256(data).hexdigest())


def job_file(
    run_dir: Path | str,
    attempt: str = "t01aaaa",
    owner: RunOwner = OWNER,
    model: ModelRef = MODEL,
    inputs: tuple[str, ...] = ("/data/in",),
    id_column: str | None = "id",
) -> JobFile:
    return JobFile(
        job_id=f"batchinfer-{owner.dag_id}-{owner.task_id}-{attempt}",
        attempt=attempt,
        launcher="local",
        run_dir=str(run_dir),
        input_locations=inputs,
        input_spec=InputSpec(id_column=id_column),
        job_spec=JobSpec(),
        model=model,
        registry_root="/registry",
        airflow=owner,
    )


def manifest_for(
    run_dir: Path | str,
    files: tuple[FileEntry, ...],
    error_files: tuple[FileEntry, ...] = (),
    attempt: str = "t01aaaa",
    input_rows: int | None = None,
    fmt: str | None = None,
) -> Manifest:
    output = sum(f.rows for f in files)
    errors = sum(f.rows for f in error_files)
    extra = {"format": fmt} if fmt else {}
    return Manifest(
        run_dir=str(run_dir),
        files=files,
        error_files=error_files,
        counts=Counts(
            input_rows=output + errors if input_rows is None else input_rows, output_rows=output, error_rows=errors
        ),
        model=MODEL,
        job=JobRecord(id=f"batchinfer-dag-infer-{attempt}", attempt=attempt),
        input_locations=("/data/in",),
        input_files=("/data/in/a.parquet",),
        airflow=OWNER,
        **extra,
    )


def committed_run(run_dir: Path, rows: int = 3, attempt: str = "t01aaaa") -> Manifest:
    """A committed run directory: one part of ``rows`` rows and a ``_SUCCESS`` that lists it."""
    from airflow_provider_batchinfer.contract import SUCCESS_MARKER

    run_dir.mkdir(parents=True, exist_ok=True)
    entry = write_part(run_dir, part_name(0, attempt), list(range(rows)))
    manifest = manifest_for(run_dir, (entry,), attempt=attempt)
    (run_dir / SUCCESS_MARKER).write_text(manifest.to_json())
    return manifest
