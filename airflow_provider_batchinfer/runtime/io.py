"""Reading the input and writing the parts: the Ray Data ends of the pipeline.

The datasink follows Ray Data's own protocol: ``write`` is one task that streams its blocks into
one Parquet part with a deterministic name (``part-<task>-<attempt>``), so a retried write task
overwrites its own part instead of leaving a duplicate, and returns what it wrote. The commit
(reconciling counts and writing ``_SUCCESS``) happens once, on the driver, after every part is
durable; see ``job.py``.
"""

from __future__ import annotations

from typing import Any, Iterable

from airflow_provider_batchinfer.inputs import InputError, inspect_input, list_input_files  # noqa: F401  (re-exported)
from airflow_provider_batchinfer.stage import Stage


def row_bytes(location: str, columns: list[str], storage_options: dict[str, Any] | None) -> float:
    """Uncompressed bytes per row of ``columns``, from one file's footer (sizes batches)."""
    import pyarrow.parquet as pq

    stage = Stage.open(location, storage_options)
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
    """A tiny Ray actor that write tasks report finished rows to; the driver reads it to log progress."""

    def __init__(self) -> None:
        self.rows = 0

    def add(self, rows: int) -> None:
        self.rows += rows

    def get(self) -> int:
        return self.rows


class _PartWriter:
    """One Parquet part, opened on its first non-empty table (an empty part is never written)."""

    def __init__(self, stage: Stage, name: str) -> None:
        self.stage, self.name = stage, name
        self.writer = self.sink = None
        self.rows = 0

    def write(self, table: Any) -> None:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.stage.fs.create_dir(self.stage.path.rsplit("/", 1)[0], recursive=True)
            self.sink = self.stage.fs.open_output_stream(self.stage.path)
            self.writer = pq.ParquetWriter(self.sink, table.schema, compression="zstd")
        elif not table.schema.equals(self.writer.schema):
            table = table.select(self.writer.schema.names).cast(self.writer.schema)
        self.writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> dict[str, Any] | None:
        if self.writer is None:
            return None
        self.writer.close()
        self.sink.close()
        return {"name": self.name, "size": self.stage.fs.get_file_info(self.stage.path).size, "rows": self.rows}


class PartsDatasink:
    """Writes Parquet parts into the run directory and returns (name, size, rows) per part.

    Rows the model could not score (dead-lettered, see ``runtime/errors.py``) go to
    ``_errors/part-<task>-<attempt>.parquet`` with their ``error_columns`` and message."""

    def __init__(self, run_dir: str, attempt: str, storage_options: dict[str, Any] | None, counter: Any = None,
                 error_columns: list[str] | None = None) -> None:
        self.run_dir = run_dir
        self.attempt = attempt
        self.storage_options = storage_options
        self.counter = counter
        self.error_columns = list(error_columns or [])
        self.parts: list[dict[str, Any]] = []
        self.error_parts: list[dict[str, Any]] = []

    # Ray Data looks these up on the datasink class; see ray.data.Datasink.
    def write(self, blocks: Iterable[Any], ctx: Any) -> list[dict[str, Any]]:
        name = f"part-{ctx.task_idx:05d}-{self.attempt}.parquet"
        run_dir = Stage.open(self.run_dir, self.storage_options)
        # an S3 failure that outlived the client's retries names the bucket, key and what was done
        with run_dir.child(name)._io("write"):
            return self._write(blocks, run_dir, name)

    def _write(self, blocks: Iterable[Any], run_dir: Stage, name: str) -> list[dict[str, Any]]:
        from ray.data.block import BlockAccessor

        from airflow_provider_batchinfer.runtime.errors import ERRORS_DIR, split_errors

        out = _PartWriter(run_dir.child(name), name)
        errors = _PartWriter(run_dir.child(ERRORS_DIR, name), f"{ERRORS_DIR}/{name}")
        try:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                good, bad = split_errors(table, self.error_columns)
                if good is not None:
                    out.write(good)
                    if self.counter is not None:
                        self.counter.add.remote(good.num_rows)
                if bad is not None:
                    errors.write(bad)
        finally:
            written = [out.close(), errors.close()]
        return [w for w in written if w]


def make_datasink(run_dir: str, attempt: str, storage_options: dict[str, Any] | None, counter: Any = None,
                  error_columns: list[str] | None = None):
    """A ``ray.data.Datasink`` subclass instance; built lazily so importing this module needs no Ray."""
    from ray.data import Datasink

    from airflow_provider_batchinfer.runtime.errors import ERRORS_DIR

    class _Sink(PartsDatasink, Datasink):
        def on_write_complete(self, write_result) -> None:
            entries = [e for returned in write_result.write_returns if returned for e in returned]
            self.parts = sorted((e for e in entries if not e["name"].startswith(ERRORS_DIR + "/")),
                                key=lambda e: e["name"])
            self.error_parts = sorted((e for e in entries if e["name"].startswith(ERRORS_DIR + "/")),
                                      key=lambda e: e["name"])

        def get_name(self) -> str:
            return "WriteParts"

    return _Sink(run_dir, attempt, storage_options, counter, error_columns)
