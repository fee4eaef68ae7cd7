"""Reading the job's Parquet input: one reader for both engines.

The driver reads every input file's footer before any compute (``inputs.inspect_input``), so it
already knows each file's row groups and their rows. Both engines read with :func:`row_group_batches`:
the driver's reader thread (``in_driver_io.py``) file by file, and the actor pool's read tasks
through :class:`InputFilesDatasource`, a ``ray.data.Datasource`` that plans its read tasks from
those footers. ``ray.data.read_parquet`` would list the files and read every footer again on the
cluster first, in a listing task and footer-reading actors of their own: Ray worker processes that
start for every job and hold nothing the driver does not already know.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.runtime.tuning import TUNING
from airflow_provider_batchinfer.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa

#: One read unit: (input file number, row group number, rows in that row group).
RowGroup = tuple[int, int, int]


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


#: the most read tasks a job plans (Ray Data's own default for large reads is in the hundreds)
MAX_READ_TASKS = 10_000


def read_tasks(file_groups: Sequence[Sequence[int]], row_bytes: float) -> int:
    """How many read tasks to plan: one per ``Tuning.read_task_bytes`` of input, at most one per
    non-empty row group and ``MAX_READ_TASKS``. Ray Data is told exactly this many
    (``override_num_blocks``): left to choose, it asks for twice the cluster's CPUs and splits each
    task's output into smaller blocks, and a replica waiting for a whole batch can then wait on a
    split-off block that the read's object-store budget holds back."""
    groups = sum(1 for rows_of in file_groups for rows in rows_of if rows)
    by_size = -(-int(sum(map(sum, file_groups)) * row_bytes) // TUNING.read_task_bytes)
    return max(1, min(MAX_READ_TASKS, groups, by_size))


def split_row_groups(file_groups: Sequence[Sequence[int]], tasks: int) -> list[list[RowGroup]]:
    """The input's non-empty row groups in at most ``tasks`` runs of consecutive row groups with
    about as many rows each: fewer files than read tasks still spread over the tasks."""
    units = [(f, g, rows) for f, groups in enumerate(file_groups) for g, rows in enumerate(groups) if rows]
    if not units:
        return []
    target = -(-sum(u[2] for u in units) // max(1, min(tasks, len(units))))
    runs: list[list[RowGroup]] = [[]]
    taken = 0
    for unit in units:
        if taken >= target:
            runs.append([])
            taken = 0
        runs[-1].append(unit)
        taken += unit[2]
    return runs


def _read_run(
    files: Sequence[str],
    storage_options: Mapping[str, Any] | None,
    columns: Sequence[str],
    rows: int,
    run: Sequence[RowGroup],
) -> Iterator[pa.Table]:
    """A read task's body: its row groups, file by file, in order."""
    index = 0
    while index < len(run):
        file_number = run[index][0]
        groups = []
        while index < len(run) and run[index][0] == file_number:
            groups.append(run[index][1])
            index += 1
        yield from row_group_batches(files[file_number], storage_options, columns, groups, rows, use_threads=True)


def input_files_datasource(
    files: Sequence[str],
    file_groups: Sequence[Sequence[int]],
    columns: Sequence[str],
    storage_options: Mapping[str, Any] | None,
    rows: int,
    row_bytes: float,
) -> Any:
    """An :class:`InputFilesDatasource`; built lazily so importing this module needs no Ray."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class InputFilesDatasource(Datasource):
        """The job's input files, read in tasks planned from the footers the driver read."""

        def __init__(self) -> None:
            super().__init__()
            self.total_rows = sum(sum(groups) for groups in file_groups)

        def get_name(self) -> str:
            return "ReadInput"

        def estimate_inmemory_data_size(self) -> int | None:
            return int(self.total_rows * row_bytes)

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, **_: Any) -> list[Any]:
            tasks = []
            for run in split_row_groups(file_groups, parallelism):
                run_rows = sum(unit[2] for unit in run)
                metadata = BlockMetadata(
                    num_rows=run_rows,
                    size_bytes=int(run_rows * row_bytes),
                    input_files=[files[f] for f in sorted({unit[0] for unit in run})],
                    exec_stats=None,
                )
                body = partial(_read_run, list(files), storage_options, list(columns), rows, run)
                tasks.append(ReadTask(body, metadata, per_task_row_limit=per_task_row_limit))
            return tasks

    return InputFilesDatasource()
