"""Reading the job's Parquet input in the driver process (``in_driver_io.py``): the row groups the
driver's checks found in each footer (``inputs.inspect_input``), one at a time.

The actor pool reads with ``ray.data.read_parquet`` (``io.read_input``), which lists the files and
reads their footers again on the cluster (``docs/performance.md``, the actor pool).

A file whose bytes do not decode (a page cut short or overwritten behind an intact footer) fails the
job with ``inputs.CorruptInputError`` naming it, on both engines: here by :func:`row_group_batches`,
on the pool by :func:`corrupt_read_error`, from what Ray Data's read task says.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.runtime.errors import exception_chain
from airflow_provider_batchinfer.store.inputs import (
    CorruptInputError,
    corrupt_file,
    is_corrupt_parquet,
    reading_parquet,
)
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa


def row_group_batches(
    location: str,
    storage_options: Mapping[str, Any] | None,
    columns: Sequence[str],
    row_groups: Sequence[int],
    rows: int,
    use_threads: bool = False,
) -> Iterator[pa.Table]:
    """The ``columns`` of ``row_groups`` of one Parquet file, in tables of at most ``rows`` rows.
    One row group at a time: over a whole file pyarrow pre-buffers every row group's column chunks
    at once (a 250k-row, 97 MB file was held whole); per row group it coalesces that group's reads
    (what S3 needs) and holds only them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stage = Stage.open(location, dict(storage_options) if storage_options else None)
    # a store's failure becomes its StageError outside; a corrupt file's is named inside
    with stage._io("read"), reading_parquet(location), stage.fs.open_input_file(stage.path) as source:
        reader = pq.ParquetFile(source)
        for group in row_groups:
            for batch in reader.iter_batches(
                batch_size=rows, row_groups=[group], columns=list(columns), use_threads=use_threads
            ):
                yield pa.Table.from_batches([batch])


# Ray Data names the file a read task failed in only in its retry note (``iterate_with_retry``)
_FAILED_FRAGMENT = re.compile(r"Failed to read fragment (?P<path>\S+) after \d+/\d+ attempts")
_RAY_WRAPPERS = ("RayTaskError", "UserCodeException", "RaySystemError", "SystemException")


def corrupt_read_error(exc: BaseException, files: Sequence[str]) -> CorruptInputError | None:
    """The :class:`CorruptInputError` naming the input file a pool read task found corrupt, or None
    when ``exc`` is no such failure (a store's error stays the job's, and its retries may fix it).

    Ray Data wraps the read's error (``RayTaskError(OSError)`` with the pyarrow error as ``cause``)
    and says which file it was reading only in the text; the file is named as ``files`` name it."""
    chain = exception_chain(exc)
    found = next((m for e in chain if (m := _FAILED_FRAGMENT.search(str(e)))), None)
    inner = [e for e in chain if not any(w in type(e).__name__ for w in _RAY_WRAPPERS)]
    if found is None or not inner or not is_corrupt_parquet(inner[-1]):
        return None
    path = found.group("path")
    location = next((f for f in files if f == path or f.endswith("/" + path.lstrip("/"))), path)
    return corrupt_file(location, inner[-1])
