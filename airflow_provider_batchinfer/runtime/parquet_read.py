"""Reading the job's Parquet input in the driver process (``in_driver_io.py``): the row groups the
driver's checks found in each footer (``inputs.inspect_input``), one at a time.

The actor pool reads with ``ray.data.read_parquet`` (``io.read_input``), which lists the files and
reads their footers again on the cluster (``docs/performance.md``, the actor pool).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.stage import Stage

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
    with stage._io("read"), stage.fs.open_input_file(stage.path) as source:
        reader = pq.ParquetFile(source)
        for group in row_groups:
            for batch in reader.iter_batches(
                batch_size=rows, row_groups=[group], columns=list(columns), use_threads=use_threads
            ):
                yield pa.Table.from_batches([batch])
