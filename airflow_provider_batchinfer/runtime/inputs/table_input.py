"""An Iceberg table input, read by the job itself: the pinned snapshot into the job's ``_input/``.

The operator pins the snapshot (``JobFile.table_input``: identifier, public catalog properties,
snapshot id, row filter) and reads no rows: the Airflow worker's memory, disk and core would
otherwise bound every table-driven job. Here, before the driver inspects its input, the snapshot
is written as plain Parquet into ``<claim directory>/_input/<attempt>/``, and everything after
(row count, schema, id uniqueness, RESUME, part boundaries, both engines' reads) works on those
files as on any Parquet input.

1. The driver opens the catalog as the table-output commit does (``open_catalog`` with the job
   file's public properties; the secret ones come from its environment, delivered like its S3
   credentials) and plans the scan once: the pinned snapshot, the row filter, its schema.
2. The data files (each with its delete files) are packed in path order into groups of at least
   :data:`MIN_GROUP_ROWS` rows by their record counts, and each group becomes
   ``part-<group>-<n>.parquet`` files. On Ray every group is a task on the cluster (in parallel:
   the read never runs in one process); for a job the driver scores on the embedded default it is
   read here, one data file at a time, batch by batch. pyiceberg's ``ArrowScan`` reads each group,
   so positional and equality deletes and schema evolution are honoured as any Iceberg reader does.
3. A retry reads the same snapshot with the same plan: the same rows in the same files. Each attempt
   writes its own subdirectory, so an earlier attempt still running (a zombie) never rewrites a
   file this one is reading.

Read tasks get no secret: they rebuild the table's FileIO from its public properties and the
stage's S3 settings, with the credentials every Ray worker already has in its environment
(``attach.worker_runtime_env``): data files are read with the job's storage credentials, as table
outputs are written with them. Imports no Airflow.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import placement
from airflow_provider_batchinfer.store.iceberg.catalog import CatalogError, open_catalog, public_catalog
from airflow_provider_batchinfer.store.iceberg.read import load_table
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.io import FileIO
    from pyiceberg.table import FileScanTask

    from airflow_provider_batchinfer.contract import JobFile
    from airflow_provider_batchinfer.contract.tables import TableInput

#: a group (one read task) holds data files up to at least this many rows: small files share a task
MIN_GROUP_ROWS = 250_000
#: the most rows per written Parquet file (a larger group rolls over into the next file)
ROWS_PER_FILE = 1_000_000
#: rows gathered before a row group is written: a filter can leave very small batches
_ROW_GROUP_ROWS = 131_072
#: FileIO properties the read tasks must not be given: the catalog's own address
_NOT_FOR_READS = frozenset({"uri", "name"})
#: whether the read tasks attached this process to Ray (one job per runtime process)
_ray_state = {"attached": False}


@dataclass(frozen=True)
class PlannedScan:
    """What every read task shares: the table's metadata, the projection and filter of the pinned
    scan, the plain Arrow schema the files get, the FileIO's public properties, and where to write."""

    metadata: Any  # pyiceberg TableMetadata
    projection: Any  # pyiceberg Schema: the snapshot's schema
    row_filter: Any  # pyiceberg BooleanExpression
    schema: pa.Schema
    io_properties: Mapping[str, str]
    storage: Mapping[str, Any] | None
    dest: str


def read_table_input(job: JobFile, storage: Mapping[str, Any] | None) -> list[str]:
    """Write the job's pinned table input as Parquet under its ``_input/<attempt>/``; the
    locations to list the input files from (the job file's own ones for any other input)."""
    ref = job.table_input
    if ref is None:
        return list(job.input_locations)
    started = time.monotonic()
    dest = Stage.open(job.input_locations[0], dict(storage) if storage else None).child(job.attempt)
    table, data_scan, shared = _open_scan(ref, storage, dest.location)
    tasks = sorted(data_scan.plan_files(), key=lambda t: str(t.file.file_path))
    groups = pack(tasks)
    here = in_this_process(job, sum(int(t.file.record_count) for t in tasks))
    dest.fs.create_dir(dest.path, recursive=True)
    if here:
        rows = sum(write_group(shared, i, group, table.io) for i, group in enumerate(groups))
    else:
        rows = _write_on_ray(job, shared, groups)
    if rows == 0:  # nothing matched: an empty file, so the input check says "holds 0 rows"
        write_group(shared, 0, [], table.io)
    where = "in the driver process" if here else "on Ray"
    print(
        f"[batchinfer] input: {rows:,} rows of Iceberg table {ref.identifier} at snapshot {ref.snapshot_id}"
        f"{f' where {ref.row_filter}' if ref.row_filter else ''} read in {len(groups)} task(s) {where} "
        f"({len(tasks)} data file(s), {time.monotonic() - started:.1f} s) into {dest.location}",
        flush=True,
    )
    return [dest.location]


def in_this_process(job: JobFile, planned_rows: int) -> bool:
    """Whether the snapshot is read in the driver process: exactly when the driver will score the
    job (``in_driver.why_not``, with the planned rows, an upper bound, for the rows to score);
    a job on the actor pool reads it in Ray tasks."""
    limit = placement.max_rows_setting(job.job_spec.in_driver_max_rows, os.environ)
    if limit is None or placement.spec_reason(job, limit, os.environ) is not None:
        return False
    return placement.rows_reason(job, planned_rows, limit) is None


def _open_scan(ref: TableInput, storage: Mapping[str, Any] | None, dest: str) -> tuple[Any, Any, PlannedScan]:
    """The pinned table, its scan, and the scan's shared state for the read tasks; a missing table
    or snapshot fails for good."""
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.expressions.parser import parse
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    catalog = open_catalog(ref.catalog, storage)
    table = load_table(catalog, ref.identifier)
    if table is None:
        raise CatalogError(f"input table {ref.identifier} does not exist in the catalog")
    if ref.snapshot_id is None or table.snapshot_by_id(ref.snapshot_id) is None:
        raise CatalogError(
            f"input table {ref.identifier} has no snapshot {ref.snapshot_id} (expired, or from another table); "
            "nothing was read"
        )
    row_filter = parse(ref.row_filter) if ref.row_filter else AlwaysTrue()
    data_scan = table.scan(row_filter=row_filter, snapshot_id=ref.snapshot_id)
    projection = data_scan.projection()
    public = {k: v for k, v in public_catalog(table.io.properties).items() if k not in _NOT_FOR_READS}
    scan = PlannedScan(
        metadata=table.metadata,
        projection=projection,
        row_filter=row_filter,
        schema=plain_schema(schema_to_pyarrow(projection, include_field_ids=False)),
        io_properties=public,
        storage=dict(storage) if storage else None,
        dest=dest,
    )
    return table, data_scan, scan


def pack(tasks: Sequence[FileScanTask], min_rows: int | None = None) -> list[list[FileScanTask]]:
    """Consecutive data files grouped until a group holds ``min_rows`` (:data:`MIN_GROUP_ROWS`) rows
    by their record counts: one read task each. A large file is a group of its own, small ones share one."""
    min_rows = MIN_GROUP_ROWS if min_rows is None else min_rows
    groups: list[list[FileScanTask]] = []
    rows = min_rows
    for task in tasks:
        if rows >= min_rows:
            groups.append([])
            rows = 0
        groups[-1].append(task)
        rows += int(task.file.record_count)
    return groups


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """pyiceberg reads strings as ``large_string`` (and lists as ``large_list``); the model signature
    checks speak ``string``: the plain types, and no Iceberg field ids (the copy is plain Parquet,
    its columns known by name)."""
    import pyarrow as pa

    def plain(t: pa.DataType) -> pa.DataType:
        if pa.types.is_large_string(t):
            return pa.string()
        if pa.types.is_large_binary(t):
            return pa.binary()
        if pa.types.is_large_list(t) or pa.types.is_list(t):
            return pa.list_(plain(t.value_type))
        return t

    return pa.schema([f.with_type(plain(f.type)).remove_metadata() for f in schema])


def _file_io(scan: PlannedScan) -> FileIO:
    """The table's FileIO in a read task: its public properties, the stage's S3 settings and this
    worker's own credentials (``catalog.io_properties`` reads them from its environment)."""
    from pyiceberg.io import load_file_io

    from airflow_provider_batchinfer.store.iceberg.catalog import io_properties

    return load_file_io({**io_properties(scan.storage), **scan.io_properties}, scan.metadata.location)


def _batches(scan: PlannedScan, tasks: Iterable[FileScanTask], io: FileIO) -> Iterator[pa.RecordBatch]:
    """The group's rows, one data file at a time (``ArrowScan`` holds a whole file's batches of
    the files it is given at once), with its deletes applied and the filter's residual."""
    from pyiceberg.io.pyarrow import ArrowScan

    reader = ArrowScan(scan.metadata, io, scan.projection, scan.row_filter)
    for task in tasks:
        yield from reader.to_record_batches((task,))


def write_group(scan: PlannedScan, index: int, tasks: Sequence[FileScanTask], io: FileIO | None = None) -> int:
    """Read one group and write its rows as ``part-<index>-<n>.parquet`` (no file for no rows, but
    for an empty group: the one empty file of an input nothing matched); the rows written. ``io``:
    the driver's own FileIO; a read task builds one from the scan's public properties."""

    dest = Stage.open(scan.dest, dict(scan.storage) if scan.storage else None)
    io = io if io is not None else _file_io(scan)
    writer = _PartWriter(dest, index, scan.schema)
    pending: list[pa.RecordBatch] = []
    buffered = 0
    try:
        for batch in _batches(scan, tasks, io):
            pending.append(batch)
            buffered += batch.num_rows
            if buffered >= _ROW_GROUP_ROWS:
                writer.write(pending)
                pending, buffered = [], 0
        if pending or not tasks:
            writer.write(pending)
    finally:
        writer.close()
    return writer.rows


class _PartWriter:
    """Parquet files ``part-<index>-<n>.parquet`` in ``dest``, rolled over every
    :data:`ROWS_PER_FILE` rows, each batch cast to the plain ``schema``."""

    def __init__(self, dest: Stage, index: int, schema: pa.Schema) -> None:
        self.dest, self.index, self.schema = dest, index, schema
        self.rows = 0
        self._file_rows = 0
        self._files = 0
        self._out: Any = None
        self._writer: Any = None

    def write(self, batches: list[pa.RecordBatch]) -> None:
        import pyarrow as pa

        # each batch on its own: files written under older schemas may differ in field metadata
        tables = [
            pa.Table.from_arrays(pa.Table.from_batches([b]).cast(self.schema).columns, schema=self.schema)
            for b in batches
        ]
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        if self._writer is None or self._file_rows >= ROWS_PER_FILE:
            self._open()
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        self.rows += table.num_rows
        self._file_rows += table.num_rows

    def _open(self) -> None:
        import pyarrow.parquet as pq

        self.close()
        part = self.dest.child(f"part-{self.index:05d}-{self._files:03d}.parquet")
        with part._io("write"):
            self._out = part.fs.open_output_stream(part.path)
            self._writer = pq.ParquetWriter(self._out, self.schema, compression="zstd")
        self._files += 1
        self._file_rows = 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._out.close()
        self._writer = self._out = None


def _write_on_ray(job: JobFile, scan: PlannedScan, groups: Sequence[Sequence[FileScanTask]]) -> int:
    """Every group a task on the cluster, one CPU each, spread over its nodes (a read that stays on
    the driver's node uses one node's disk and network); the rows they wrote. The job log names the
    nodes the tasks ran on. Ray stays attached for the pipeline (:func:`attached_to_ray`)."""
    import ray

    if not groups:
        return 0
    attach_for_reads(job)
    shared = ray.put(scan)
    task = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_read_task)
    done: list[tuple[int, str]] = ray.get([task.remote(shared, i, group) for i, group in enumerate(groups)])
    nodes = Counter(node for _, node in done)
    print(
        f"[batchinfer] input: read tasks ran on {len(nodes)} node(s): "
        + ", ".join(f"{node} ({count} task(s))" for node, count in sorted(nodes.items())),
        flush=True,
    )
    return sum(rows for rows, _ in done)


def _read_task(scan: PlannedScan, index: int, tasks: Sequence[FileScanTask]) -> tuple[int, str]:
    """One group read on a Ray worker: the rows written and the id of the node it ran on."""
    import ray

    return write_group(scan, index, tasks), ray.get_runtime_context().get_node_id()


def attach_for_reads(job: JobFile) -> None:
    """Attach this process to the job's Ray for an input's read tasks (a table's groups, a query's
    shards), once; the pipeline then uses that connection (:func:`attached_to_ray`)."""
    import ray

    from airflow_provider_batchinfer.runtime.attach import init_ray

    if not ray.is_initialized():
        init_ray(job)
        _ray_state["attached"] = True


def attached_to_ray() -> bool:
    """Whether an input's read tasks attached this process to Ray (and it still is): the pipeline
    uses that connection instead of attaching again."""
    import sys

    ray = sys.modules.get("ray")
    return _ray_state["attached"] and ray is not None and ray.is_initialized()


def leave_ray() -> None:
    """Detach from the Ray the read tasks attached to, when the driver then scores the job itself
    (the planned rows were an upper bound: a filter or RESUME left few to score)."""
    if attached_to_ray():
        import ray

        ray.shutdown()
    _ray_state["attached"] = False
