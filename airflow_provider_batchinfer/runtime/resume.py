"""SaveMode.RESUME on the Ray side: keep what earlier attempts committed, score only the rest.

A preempted attempt leaves complete parts (each one a whole Parquet file with its footer, written
by one Ray write task) and perhaps one part cut off mid-write (no footer). The next attempt of the
same run keeps every complete part, deletes the cut-off ones, collects the ids those parts hold
(``InputSpec.id_column``) and filters those rows out of the input, so each row ends up in exactly
one listed file of the final manifest. The operator decides whether resuming is allowed (same
task, run, model sha256 and input; see ``_resume_allowed``); this module only reads and filters.

Cost: the driver holds the kept ids in memory (8 bytes a row for integer ids) and every read
block looks its ids up in that sorted array (``O(rows x log kept)``, no per-block hash build).
"""

from __future__ import annotations

import re
from typing import Any

from airflow_provider_batchinfer.runtime.errors import ERRORS_DIR
from airflow_provider_batchinfer.stage import Stage

_PART = re.compile(rf"^(?:{ERRORS_DIR}/)?part-[^/]+\.parquet$")


class ResumeError(RuntimeError):
    """The kept parts cannot be trusted for a resume; the message says what to do."""


def collect_committed(run_dir: Stage, id_column: str) -> dict[str, Any]:
    """The complete parts already in ``run_dir`` and the ids they hold.

    Returns ``{"files": [...], "error_files": [...], "rows", "error_rows", "ids": numpy array (sorted),
    "removed": [names]}``. A part without a readable footer was cut off mid-write: it is deleted
    (its rows are scored again). A part whose ids overlap an earlier kept part is deleted too, so
    no row is ever listed twice."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    files: list[dict[str, Any]] = []
    error_files: list[dict[str, Any]] = []
    chunks: list[Any] = []
    removed: list[str] = []
    for rel, size in run_dir.list_files():
        if not _PART.match(rel):
            continue
        part = run_dir.child(*rel.split("/"))
        try:
            with part.fs.open_input_file(part.path) as f:
                pf = pq.ParquetFile(f)
                if id_column not in pf.schema_arrow.names:
                    raise ResumeError(
                        f"{part.location} has no column {id_column!r} (InputSpec.id_column), so its rows cannot be "
                        "matched to the input; re-run with SaveMode.OVERWRITE"
                    )
                ids = pf.read(columns=[id_column]).column(id_column)
        except ResumeError:
            raise
        except Exception as exc:  # no footer / truncated: the write task died mid-file
            part.delete()
            removed.append(rel)
            print(f"[batchinfer] resume: removed {rel} ({size:,} bytes): cut off mid-write ({type(exc).__name__}); "
                  "its rows are scored again", flush=True)
            continue
        if chunks and len(ids):
            seen = pa.chunked_array([c for chunk in chunks for c in chunk.chunks], type=ids.type)
            if pc.any(pc.is_in(ids, value_set=seen)).as_py():
                part.delete()
                removed.append(rel)
                print(f"[batchinfer] resume: removed {rel}: it repeats rows of an earlier part", flush=True)
                continue
        chunks.append(ids)
        entry = {"name": rel, "size": size, "rows": len(ids)}
        (error_files if rel.startswith(ERRORS_DIR + "/") else files).append(entry)
    if chunks:
        done = pa.chunked_array([c for chunk in chunks for c in chunk.chunks], type=chunks[0].type)
        ids_np = np.sort(done.to_numpy())
    else:
        ids_np = np.array([], dtype=np.int64)
    return {
        "files": files,
        "error_files": error_files,
        "rows": sum(f["rows"] for f in files),
        "error_rows": sum(f["rows"] for f in error_files),
        "ids": ids_np,
        "removed": removed,
    }


def drop_done(batch: Any, id_column: str, done: Any) -> Any:
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
