"""SaveMode.RESUME on the Ray side: keep what earlier attempts committed, score only the rest.

A preempted attempt leaves complete parts (each one a whole Parquet file with its footer, written
by one Ray write task) and perhaps one part cut off mid-write (no footer). The next attempt of the
same run keeps every complete part, deletes the cut-off ones, collects the ids those parts hold
(``InputSpec.id_column``) and filters those rows out of the input, so each row ends up in exactly
one listed file of the final manifest. The operator decides whether resuming is allowed (the same
task instance and result identity: input content, model, params, engine, columns, output schema
and part boundaries; see ``rundir.prepare``); this module only reads and filters.

The earlier attempt recorded nothing about its parts (it died before its commit), so their sizes
and sha256 checksums for the manifest are computed here, from the same single read that checks
each part's footer and collects its ids: every kept part is read once, never twice.

Cost: the driver holds the kept ids in memory (8 bytes a row for integer ids) and every read
block looks its ids up in that sorted array (``O(rows x log kept)``, no per-block hash build).
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any, TypedDict

from airflow_provider_batchinfer.contract import ERRORS_DIR, FileEntry
from airflow_provider_batchinfer.stage import Stage

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from airflow_provider_batchinfer.contract import JobFile

_PART = re.compile(rf"^(?:{ERRORS_DIR}/)?part-[^/]+\.parquet$")


class ResumeError(RuntimeError):
    """The kept parts cannot be trusted for a resume; the message says what to do."""


class KeptParts(TypedDict):
    """What earlier attempts left that this one keeps: parts and dead-letter files (with their
    checksums), their rows, the ids they hold (sorted) and the names of the parts deleted."""

    files: list[FileEntry]
    error_files: list[FileEntry]
    rows: int
    error_rows: int
    ids: np.ndarray
    removed: list[str]


def nothing_kept() -> KeptParts:
    import numpy as np

    return {"files": [], "error_files": [], "rows": 0, "error_rows": 0, "ids": np.array([]), "removed": []}


def _read_part(part: Stage, id_column: str) -> tuple[pa.ChunkedArray, str, int]:
    """(ids, sha256, size) of one part from a single read: the bytes are hashed, then parsed from
    memory (footer check and id column). Raises ResumeError when the part has no id column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with part.fs.open_input_stream(part.path) as f:
        data = f.read()
    pf = pq.ParquetFile(pa.BufferReader(data))
    if id_column not in pf.schema_arrow.names:
        raise ResumeError(
            f"{part.location} has no column {id_column!r} (InputSpec.id_column), so its rows cannot be "
            "matched to the input; re-run with SaveMode.OVERWRITE"
        )
    return pf.read(columns=[id_column]).column(id_column), hashlib.sha256(data).hexdigest(), len(data)


def collect_committed(run_dir: Stage, id_column: str) -> KeptParts:
    """The complete parts already in ``run_dir``, with their checksums, and the ids they hold.

    Each part is read once (hashed and parsed from the same bytes). A part without a readable
    footer was cut off mid-write: it is deleted (its rows are scored again). A part whose ids overlap
    an earlier kept part is deleted too, so no row is ever listed twice."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    files: list[FileEntry] = []
    error_files: list[FileEntry] = []
    chunks: list[Any] = []
    removed: list[str] = []
    for rel, size in run_dir.list_files():
        if not _PART.match(rel):
            continue
        part = run_dir.child(*rel.split("/"))
        try:
            ids, sha256, size = _read_part(part, id_column)
        except ResumeError:
            raise
        except Exception as exc:  # no footer / truncated: the write task died mid-file
            part.delete()
            removed.append(rel)
            print(
                f"[batchinfer] resume: removed {rel} ({size:,} bytes): cut off mid-write ({type(exc).__name__}); "
                "its rows are scored again",
                flush=True,
            )
            continue
        if chunks and len(ids):
            seen = pa.chunked_array([c for chunk in chunks for c in chunk.chunks], type=ids.type)
            if pc.any(pc.is_in(ids, value_set=seen)).as_py():
                part.delete()
                removed.append(rel)
                print(f"[batchinfer] resume: removed {rel}: it repeats rows of an earlier part", flush=True)
                continue
        chunks.append(ids)
        entry = FileEntry(name=rel, size=size, rows=len(ids), sha256=sha256)
        (error_files if rel.startswith(ERRORS_DIR + "/") else files).append(entry)
    if chunks:
        done = pa.chunked_array([c for chunk in chunks for c in chunk.chunks], type=chunks[0].type)
        ids_np = np.sort(done.to_numpy())
    else:
        ids_np = np.array([], dtype=np.int64)
    return {
        "files": files,
        "error_files": error_files,
        "rows": sum(f.rows for f in files),
        "error_rows": sum(f.rows for f in error_files),
        "ids": ids_np,
        "removed": removed,
    }


def drop_done(batch: pa.Table, id_column: str, done: np.ndarray) -> pa.Table:
    """The rows of ``batch`` whose id is not in ``done`` (a sorted numpy array): a Ray Data
    ``map_batches`` function, fused with the read."""
    import numpy as np

    ids = batch.column(id_column).to_numpy()
    pos = np.searchsorted(done, ids)
    found = (pos < len(done)) & (done[np.minimum(pos, len(done) - 1)] == ids)
    if not found.any():
        return batch
    import pyarrow as pa

    return batch.filter(pa.array(~found))


def resume_state(job: JobFile, run_dir: Stage) -> KeptParts:
    """What earlier attempts of this run left to keep (``SaveMode.RESUME``, ``job.resume``), or nothing.

    Fenced first: a late zombie must not delete (cut-off) parts in a directory another attempt owns."""
    if not job.resume:
        return nothing_kept()
    from airflow_provider_batchinfer.rundir import FencedError, check_fence
    from airflow_provider_batchinfer.runtime.errors import JobError

    id_column = job.input_spec.id_column
    if not id_column:
        raise JobError("SaveMode.RESUME needs InputSpec.id_column to know which rows are done")
    try:
        check_fence(run_dir, job.attempt)
    except FencedError as exc:
        raise FencedError(f"attempt {job.attempt} does not own {run_dir.location}; not resuming ({exc})") from exc
    kept = collect_committed(run_dir, id_column)
    print(
        f"[batchinfer] resume: keeping {len(kept['files'])} part(s) with {kept['rows']:,} row(s) and "
        f"{len(kept['error_files'])} dead-letter file(s) with {kept['error_rows']:,} row(s) from earlier attempts",
        flush=True,
    )
    return kept
