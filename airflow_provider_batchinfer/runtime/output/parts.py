"""Reading the input and writing the parts: the Ray Data ends of the pipeline.

The datasink follows Ray Data's own protocol: ``write`` is one task that streams its blocks into
one Parquet part with a deterministic name (``part-<task>-<attempt>``), so a retried write task
overwrites its own part instead of leaving a duplicate, and returns what it wrote as
:class:`~airflow_provider_batchinfer.contract.FileEntry` (name, bytes, rows and the sha256 of the
bytes, computed while they are written: a part is never read back to be hashed). The commit
(reconciling counts and writing ``_SUCCESS``) happens once, on the driver, after every part is
durable; see ``driver.py`` and ``commit.py``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import ERRORS_DIR, FileEntry, part_name
from airflow_provider_batchinfer.runtime.tuning import TUNING
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa


# Ray Data 2.60 reads Parquet footers in a pool of actors it starts for every read_parquet call: 32
# by default, each a fresh Ray worker process (~1-1.5 CPU-seconds to start, killed after the
# listing), although one actor reads ten files' footers per call, two calls in flight each, with
# 128 reads in flight. On two cores those starts were most of a small job's listing (the cold 100-row
# job 14.7 -> 12.8 s with one actor), and four actors for a 40-file input cost a 10M-row pool job
# 6.2 CPU-s. A job gets one actor per 200 input files, at most Ray's 32; an operator's own setting
# of the variable wins.
FOOTER_ACTORS_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
FILES_PER_FOOTER_ACTOR = 200
# Ray Data 2.60 packs row groups into read tasks of up to this many bytes (``Tuning.read_task_bytes``);
# an operator's own setting of the variable wins
READ_TASK_BYTES_ENV = "RAY_DATA_PARQUET_BIN_PACKING_BYTES"


def footer_actors(files: int) -> int:
    """How many footer-reading actors the listing of ``files`` input files needs."""
    return max(1, min(32, -(-files // FILES_PER_FOOTER_ACTOR)))


def read_env(files: int, task_bytes: int | None = None) -> dict[str, str]:
    """The variables Ray Data reads when ``read_parquet`` plans the read of ``files`` input files: its
    footer readers sized to the files, its read tasks to ``task_bytes`` (default
    ``Tuning.read_task_bytes``, above)."""
    task_bytes = task_bytes or TUNING.read_task_bytes
    return {FOOTER_ACTORS_ENV: str(footer_actors(files)), READ_TASK_BYTES_ENV: str(task_bytes)}


def read_input(
    files: list[str],
    columns: list[str],
    filesystem: Any,
    remote_args: dict[str, Any],
    concurrency: int,
    task_bytes: int | None = None,
) -> Any:
    """``ray.data.read_parquet`` of the job's input, planned with :func:`read_env`. The variables are
    read when ``read_parquet`` is called, so they are set only around that call; an operator's own
    setting of one wins."""
    import os

    import ray.data

    planned = read_env(len(files), task_bytes)
    own = {name: os.environ.get(name) for name in planned}
    os.environ.update({name: value for name, value in planned.items() if own[name] is None})
    try:
        return ray.data.read_parquet(
            files, columns=columns, filesystem=filesystem, ray_remote_args=remote_args, concurrency=concurrency
        )
    finally:
        for name, value in own.items():
            if value is None:
                os.environ.pop(name, None)


def row_bytes(location: str, columns: list[str], storage_options: Mapping[str, Any] | None) -> float:
    """Uncompressed bytes per row of ``columns``, from one file's footer (sizes batches)."""
    import pyarrow.parquet as pq

    stage = Stage.open(location, dict(storage_options) if storage_options else None)
    with stage.fs.open_input_file(stage.path) as f:
        meta = pq.read_metadata(f)
    wanted = set(columns)
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            if chunk.path_in_schema.split(".")[0] in wanted:
                total += chunk.total_uncompressed_size
    return total / meta.num_rows if meta.num_rows else 0.0


class ProgressCounter:
    """A tiny Ray actor that replicas report finished rows to (the driver reads it to log progress),
    and where they run: each replica reports its Ray node once it has loaded the model, so the log
    and the manifest say how many replicas ran on which node."""

    def __init__(self) -> None:
        self.rows = 0
        self.replicas: dict[str, tuple[str, str]] = {}  # actor id -> (node id, node IP)
        self.first_report: tuple[float, int] | None = None  # (when, rows) of the first rows reported
        self.last_report_at = 0.0

    def add(self, rows: int) -> None:
        now = time.monotonic()  # this process's clock: reports from every node are timed alike
        if rows and self.first_report is None:
            self.first_report = (now, rows)
        self.rows += rows
        self.last_report_at = now

    def get(self) -> int:
        return self.rows

    def reported_rate(self) -> float | None:
        """Rows/s from the first rows reported to the last, the first report's rows left out: the
        steady rate of a job that ended before its progress log's second report (``ProgressLog``:
        a 100,000-text job on a GPU scores within one 10 s interval). None before two reports."""
        if self.first_report is None or self.last_report_at <= self.first_report[0]:
            return None
        first_at, first_rows = self.first_report
        return round((self.rows - first_rows) / (self.last_report_at - first_at), 2)

    def placed(self, actor_id: str, node_id: str, node_ip: str) -> None:
        self.replicas[actor_id] = (node_id, node_ip)

    def placements(self) -> list[tuple[str, str, str]]:
        return [(actor, node, ip) for actor, (node, ip) in sorted(self.replicas.items())]


def replicas_per_node(placements: Iterable[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """``[{"node_id", "node_ip", "replicas"}]`` from ``ProgressCounter.placements()``, busiest node first."""
    nodes: dict[tuple[str, str], int] = {}
    for _actor, node, ip in placements:
        nodes[(node, ip)] = nodes.get((node, ip), 0) + 1
    return [
        {"node_id": node, "node_ip": ip, "replicas": n}
        for (node, ip), n in sorted(nodes.items(), key=lambda item: (-item[1], item[0]))
    ]


class HashingSink:
    """A write-only file object that hashes (sha256) and counts the bytes on their way to ``stream``.

    ``pq.ParquetWriter`` accepts it as its sink, so a part's checksum and size are known the moment
    it is closed, without reading it back."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.digest = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        self.stream.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.stream.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.stream.close()

    @property
    def sha256(self) -> str:
        return self.digest.hexdigest()


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns a part dictionary-encodes: flat columns that are not floating point (labels,
    categories, strings, ids). Scores, probabilities and embeddings almost never repeat a value:
    encoding each row group's values as a dictionary first, then falling back, cost 3x the CPU of
    writing them plain and made the file 1.8x larger (1M ids and float32 predictions in 16,384-row
    row groups: 0.10 CPU-s and 8.3 MB against 0.03 CPU-s and 4.7 MB, zstd either way). Nested
    columns are named by their leaves in Parquet, so they are left plain too."""
    import pyarrow.types as pt

    return [f.name for f in schema if not (pt.is_floating(f.type) or pt.is_nested(f.type))]


def finish_rows(table: pa.Table, keep_columns: list[str], provenance: tuple[str, str] | None) -> tuple[Any, Any]:
    """(scored rows, dead-lettered rows) of a scored table, as both engines' writers write them
    (``runtime/errors.split_errors``); a job that writes a table gets its provenance columns (run
    key, model version; ``table_commit.add_provenance``) on the scored rows."""
    from airflow_provider_batchinfer.runtime.errors import split_errors

    good, bad = split_errors(table, keep_columns)
    if good is not None and provenance is not None:
        from airflow_provider_batchinfer.runtime.output.table_commit import add_provenance

        good = add_provenance(good, *provenance)
    return good, bad


class _PartWriter:
    """One Parquet part, opened on its first non-empty table (an empty part is never written)."""

    def __init__(self, stage: Stage, name: str) -> None:
        self.stage, self.name = stage, name
        self.writer: Any = None
        self.sink: HashingSink | None = None
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.stage.fs.create_dir(self.stage.path.rsplit("/", 1)[0], recursive=True)
            self.sink = HashingSink(self.stage.fs.open_output_stream(self.stage.path))
            self.writer = pq.ParquetWriter(
                self.sink, table.schema, compression="zstd", use_dictionary=dictionary_columns(table.schema)
            )
        elif not table.schema.equals(self.writer.schema):
            table = table.select(self.writer.schema.names).cast(self.writer.schema)
        self.writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> FileEntry | None:
        """Finish the file; its entry (size and sha256 of exactly the bytes written), or None when
        nothing was written."""
        if self.writer is None or self.sink is None:
            return None
        self.writer.close()
        self.sink.close()
        return FileEntry(name=self.name, size=self.sink.size, rows=self.rows, sha256=self.sink.sha256)


class PartsDatasink:
    """Writes Parquet parts into the run directory and returns a ``FileEntry`` per part.

    Rows the model could not score (dead-lettered, see ``runtime/errors.py``) go to
    ``_errors/part-<task>-<attempt>.parquet`` with their ``error_columns`` and message."""

    def __init__(
        self,
        run_dir: str,
        attempt: str,
        storage_options: Mapping[str, Any] | None,
        counter: Any = None,
        error_columns: list[str] | None = None,
        provenance: tuple[str, str] | None = None,
        rows_per_write: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.rows_per_write = rows_per_write
        self.provenance = provenance
        self.attempt = attempt
        self.storage_options = dict(storage_options) if storage_options else None
        self.counter = counter
        self.error_columns = list(error_columns or [])
        self.parts: list[FileEntry] = []
        self.error_parts: list[FileEntry] = []

    # Ray Data looks these up on the datasink class; see ray.data.Datasink.
    @property
    def min_rows_per_write(self) -> int | None:
        """Rows Ray Data gathers for one write task (one part); None: a block each."""
        return self.rows_per_write

    def write(self, blocks: Iterable[Any], ctx: Any) -> list[FileEntry]:
        name = part_name(ctx.task_idx, self.attempt)
        run_dir = Stage.open(self.run_dir, self.storage_options)
        # an S3 failure that outlived the client's retries names the bucket, key and what was done
        with run_dir.child(name)._io("write"):
            return self._write(blocks, run_dir, ctx.task_idx)

    def _write(self, blocks: Iterable[Any], run_dir: Stage, task_idx: int) -> list[FileEntry]:
        from ray.data.block import BlockAccessor

        name = part_name(task_idx, self.attempt)
        error_name = part_name(task_idx, self.attempt, dead_letter=True)
        out = _PartWriter(run_dir.child(name), name)
        errors = _PartWriter(run_dir.child(*error_name.split("/")), error_name)
        try:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                good, bad = finish_rows(table, self.error_columns, self.provenance)
                if good is not None:
                    out.write(good)
                    if self.counter is not None:
                        self.counter.add.remote(good.num_rows)
                if bad is not None:
                    errors.write(bad)
        finally:
            written = [out.close(), errors.close()]
        return [w for w in written if w]

    def record(self, entries: Iterable[FileEntry]) -> None:
        """Keep what the write tasks returned, parts and dead-letter files apart, sorted by name."""
        entries = list(entries)
        self.parts = sorted((e for e in entries if not e.name.startswith(ERRORS_DIR + "/")), key=lambda e: e.name)
        self.error_parts = sorted((e for e in entries if e.name.startswith(ERRORS_DIR + "/")), key=lambda e: e.name)


def write_here(ds: Any, sink: Any) -> None:
    """Write ``ds``'s scored blocks from this process through ``sink``, a part per block named as
    Ray's write tasks name theirs (``part-<index>-<attempt>``), then record them as Ray's write does.
    For an input read in the runtime's driver (``small_input.py``): its blocks are few and small,
    and on a cold cluster a write task is one more Ray worker process to start after the replica's,
    on the job's critical path."""
    from types import SimpleNamespace

    import ray

    returns = []
    for index, bundle in enumerate(ds.iter_internal_ref_bundles()):
        returns.append(sink.write(ray.get(list(bundle.block_refs)), SimpleNamespace(task_idx=index)))
    sink.on_write_complete(SimpleNamespace(write_returns=returns))


def make_datasink(
    run_dir: str,
    attempt: str,
    storage_options: Mapping[str, Any] | None,
    counter: Any = None,
    error_columns: list[str] | None = None,
    provenance: tuple[str, str] | None = None,
    rows_per_write: int | None = None,
) -> PartsDatasink:
    """A ``ray.data.Datasink`` subclass instance; built lazily so importing this module needs no Ray."""
    from ray.data import Datasink

    class _Sink(PartsDatasink, Datasink):
        def on_write_complete(self, write_result: Any) -> None:
            self.record(e for returned in write_result.write_returns if returned for e in returned)

        def get_name(self) -> str:
            return "WriteParts"

    return _Sink(run_dir, attempt, storage_options, counter, error_columns, provenance, rows_per_write)
