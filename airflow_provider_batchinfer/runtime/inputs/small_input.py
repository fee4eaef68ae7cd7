"""A small input on the actor pool, read in the runtime's driver and handed to Ray Data as one block.

``ray.data.read_parquet`` (``io.read_input``) plans a read on the cluster: a listing task, a
footer-reading actor and read tasks, each a Ray worker process to start on a cold cluster. For an
input of a few files and megabytes that start-up is most of the job's read, and on a small machine
it takes the CPU the replica needs to import its model library. Such an input is read here instead
(its footers first: nothing is read past :attr:`Tuning.driver_read_bytes`) and handed to Ray Data
with ``ray.data.from_blocks``, which starts no task at all (``from_arrow`` runs one for the block's
metadata, which inside the job's placement group waits for a CPU the group already holds).

The rows and parts are the file path's: an input of at most ``Tuning.read_task_bytes`` is one read
task there, whose rows come out as one block, and ``from_blocks`` of one table is one block too; the
replicas, ``rows_per_part`` and the write tasks then see the same bundle. The driver's block holds
the files' rows in their order (the read task interleaves row groups of different files), with the
schema the read task gives (the files' own, checked equal by ``inputs.inspect_input``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.runtime.tuning import TUNING
from airflow_provider_batchinfer.store.inputs import reading_parquet
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa

#: rows read at a time: the driver checks what it holds after each
BATCH_ROWS = 4096


def byte_limit() -> int:
    """The most uncompressed bytes read in the driver: never more than one read task's, so the file
    path would have read the same input as one block too."""
    return min(TUNING.driver_read_bytes, TUNING.read_task_bytes)


def read_small_input(files: list[str], columns: list[str], storage: Mapping[str, Any] | None) -> pa.Table | None:
    """``columns`` of every file, in order, as one table; None when the input is not small: more than
    ``Tuning.driver_read_files`` files, or more than :func:`byte_limit` bytes, counted from the
    footers' row groups (every column, uncompressed, as Ray Data's read planning counts them) before
    a file is read, and in memory while it is read (a dictionary-encoded column is larger there), so
    the driver never holds more than the limit and one batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not files or len(files) > TUNING.driver_read_files:
        return None
    limit, planned, held = byte_limit(), 0, 0
    batches: list[pa.RecordBatch] = []
    options = dict(storage) if storage else None
    for location in files:
        stage = Stage.open(location, options)
        # a corrupt file's error names it (inputs.CorruptInputError); a store's becomes its StageError
        with stage._io("read"), reading_parquet(location), stage.fs.open_input_file(stage.path) as source:
            parquet = pq.ParquetFile(source)
            meta = parquet.metadata
            planned += sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
            if planned > limit:
                return None
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=list(columns), use_threads=False):
                held += batch.nbytes
                if held > limit:
                    return None
                batches.append(batch.select(list(columns)))
    return pa.Table.from_batches(batches)
