"""A SQL input, read by the job itself: the query's result into the job's ``_input/<attempt>/``.

The operator resolves the Airflow connection into a SQLAlchemy URL and runs no query: the Airflow
worker's memory, disk and core would otherwise bound every query-driven job. The URL reaches this
process as a secret (``SQL_URL_ENV``, delivered like the job's storage credentials) and Ray workers
through the setup hook (``attach.worker_runtime_env``), never through a task's arguments. Before
the driver inspects its input, the result is written as Parquet under ``_input/<attempt>/``, and
everything after (row count, schema, id uniqueness, RESUME, both engines' reads) works on those files.

- **In shards on Ray** when the job names ``shard_column``, the job runs on Ray, and the database
  answers ``MOD(ABS(<shard_hash_fn>(<column>)), n)`` (a probe query checks it first):
  ``ray.data.read_sql`` runs one query per shard (``WHERE MOD(...) = i``) in Ray tasks and each
  shard becomes ``part-<shard>-<n>.parquet``. Each shard is fetched whole by its task, so more
  shards bound a task's memory; the shards are separate queries, so a table written to while they
  run may be read at different moments by each.
- **Streamed by the driver** otherwise: ``chunk_rows`` rows fetched at a time, each chunk one
  ``part-NNNNN.parquet`` cast to the first chunk's schema, so memory stays at one chunk.

Each attempt runs the query once, so all of an attempt's rows come from one result. A
``SaveMode.RESUME`` attempt compares its result with the one its kept parts were scored from
(``SqlInput.kept_digest``: carried in the claim from one resumed attempt to the next, never taken
from whichever attempt wrote ``_input/`` last; see ``rundir.prepare``) and drops them when it
differs (``rundir.confirm_requeried_input``), before it writes any part of its own.

A result of no rows (a daily query whose day has none) follows ``InputSpec.on_empty`` as Parquet
files of 0 rows do: fail or skip the task (``EmptyInputError``, permanent), or commit 0 rows.
Imports no Airflow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from contextlib import closing
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import placement
from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.runtime.inputs import table_input
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.inputs import EmptyInputError, InputError
from airflow_provider_batchinfer.store.redact import clip
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.contract import JobFile
    from airflow_provider_batchinfer.contract.sql_input import SqlInput


class SqlInputError(InputError):
    """The query's result cannot be scored (no result set, types that change); no retry helps. A
    result of no rows is an ``EmptyInputError``, which ``InputSpec.on_empty`` decides on."""

    permanent = True


def connect() -> Any:
    """A DB-API connection to the job's database, from the URL in this process's environment (the
    driver's delivered secrets; a worker's setup hook)."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    url = os.environ.get(SQL_URL_ENV)
    if not url:
        error = JobError(
            f"the job reads a SQL input but was given no database URL ({SQL_URL_ENV}); the operator hands it to the "
            "job with its launcher: start the job through BatchInferenceOperator"
        )
        error.permanent = True  # type: ignore[attr-defined]
        raise error
    return sqlalchemy.create_engine(url, poolclass=NullPool).raw_connection()


def read_sql_input(job: JobFile, storage: Mapping[str, Any] | None) -> list[str]:
    """Write the job's query result as Parquet under its ``_input/<attempt>/``; the locations to
    list the input files from (the job file's own ones for any other input).

    A query that returns no rows is what ``InputSpec.on_empty`` says, as for Parquet files of 0
    rows: ``"fail"`` and ``"skip"`` raise :class:`~airflow_provider_batchinfer.store.inputs.EmptyInputError`
    (permanent; the operator fails or skips the task on it), ``"commit"`` returns no location, and
    the driver commits 0 rows (``runtime/engine/empty_input.py``)."""
    ref = job.sql_input
    if ref is None:
        return list(job.input_locations)
    started = time.monotonic()
    dest = Stage.open(job.input_locations[0], dict(storage) if storage else None).child(job.attempt)
    dest.fs.create_dir(dest.path, recursive=True)
    shards = _shards(job, ref)
    if shards:
        rows, files = _read_on_ray(ref, dest, shards)
        where = f"in {shards} shard(s) by {ref.shard_column} on Ray (ray.data.read_sql)"
    else:
        rows, files = stream(ref, dest)
        where = "in the driver process, streamed"
    if rows == 0 and job.input_spec.on_empty != "commit":  # "skip": the operator skips the task on its type
        raise EmptyInputError(
            f"the input query on {ref.conn_id!r} returned no rows; nothing to score. Check the query and its "
            'data, or set InputSpec(on_empty="skip") or on_empty="commit" when a run legitimately has no rows'
        )
    print(
        f"[batchinfer] input: {rows:,} rows of the query on {ref.conn_id} read {where} "
        f"({files} file(s), {time.monotonic() - started:.1f} s) into {dest.location}",
        flush=True,
    )
    if job.resume and ref.kept_digest is not None:  # RESUME kept parts scored from the query's earlier result
        run_dir = Stage.open(job.run_dir, dict(storage) if storage else None)
        for message in rundir.confirm_requeried_input(run_dir, dest, ref.kept_digest):
            print(f"[batchinfer] {message}", flush=True)
    if rows == 0:  # on_empty="commit": no file to list (a store may keep no empty directory)
        return []
    return [dest.location]


def _shards(job: JobFile, ref: SqlInput) -> int:
    """How many shards Ray reads the query in; 0: the driver streams it (no sharding column, a job
    the driver scores without Ray, or a database that cannot hash the column: asked before Ray is
    attached, with the expression every shard's query uses)."""
    if not ref.shard_column or placement.scored_in_driver_whatever_the_rows(job, os.environ):
        return 0
    shard = f"MOD(ABS({ref.shard_hash_fn}({ref.shard_column})), 2)"
    try:
        with closing(connect()) as conn, closing(conn.cursor()) as cursor:
            cursor.execute(f"SELECT COUNT(1) FROM ({ref.query}) AS T WHERE {shard} = 0")
            cursor.fetchall()
    except JobError:
        raise
    except Exception as exc:  # the driver's own error type: named in the log, then the unsharded read
        print(
            f"[batchinfer] input: the database cannot shard the query by {shard} ({type(exc).__name__}: "
            f"{clip(str(exc), 200)}); the driver streams it instead",
            flush=True,
        )
        return 0
    import ray

    table_input.attach_for_reads(job)
    return max(2, int(ray.cluster_resources().get("CPU", 2)))


def _read_on_ray(ref: SqlInput, dest: Stage, shards: int) -> tuple[int, int]:
    """``ray.data.read_sql`` in ``shards`` shards, each written as ``part-<shard>-<n>.parquet``;
    the rows and files written (counted from the files' footers)."""
    import pyarrow.parquet as pq
    import ray.data
    from ray.data.datasource import FilenameProvider

    class ShardNames(FilenameProvider):
        """Names that a retried write task, and the same shard of a later attempt, write again
        (Ray adds ``-<n>`` before the extension for each file of a task)."""

        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"part-{task_index:05d}.parquet"

    ds = ray.data.read_sql(
        ref.query,
        connect,
        shard_keys=[ref.shard_column or ""],
        shard_hash_fn=ref.shard_hash_fn,
        override_num_blocks=shards,
    )
    ds.write_parquet(  # OVERWRITE: the names hold no write id; the directory is this attempt's own
        dest.path,
        filesystem=dest.fs,
        filename_provider=ShardNames(file_format="parquet"),
        mode=ray.data.SaveMode.OVERWRITE,
        compression="zstd",
    )
    rows = files = 0
    for name, _size in dest.list_files():
        part = dest.child(*name.split("/"))
        with part._io("read the Parquet footer of"), part.fs.open_input_file(part.path) as f:
            rows += pq.read_metadata(f).num_rows
        files += 1
    return rows, files


def stream(ref: SqlInput, dest: Stage) -> tuple[int, int]:
    """Run the query here and write ``ref.chunk_rows`` rows at a time as ``part-NNNNN.parquet``;
    the rows and files written."""
    import pyarrow.parquet as pq

    rows_total = files = 0
    schema = None
    with closing(connect()) as conn, closing(conn.cursor()) as cursor:
        cursor.execute(ref.query)
        if cursor.description is None:
            raise SqlInputError(f"the input query on {ref.conn_id!r} returned no result set; it must be a SELECT")
        names = [d[0] for d in cursor.description]
        while rows := cursor.fetchmany(ref.chunk_rows):
            table = chunk_table(names, rows, schema, rows_total + 1)
            schema = schema or table.schema
            out = dest.child(f"part-{files:05d}.parquet")
            with out._io("write"), out.fs.open_output_stream(out.path) as sink:
                pq.write_table(table, sink, compression="zstd")
            rows_total += len(rows)
            files += 1
    return rows_total, files


def chunk_table(names: list[str], rows: list[tuple[Any, ...]], schema: pa.Schema | None, first_row: int) -> pa.Table:
    """One chunk as a ``pyarrow.Table``, cast to the first chunk's schema."""
    import pyarrow as pa

    columns = list(zip(*rows, strict=False))
    try:
        table = pa.table({n: pa.array(list(c)) for n, c in zip(names, columns, strict=False)})
        if schema is not None and not table.schema.equals(schema):
            table = table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SqlInputError(
            f"the input query's rows {first_row}-{first_row + len(rows) - 1} have types that do not fit "
            f"{schema}: {exc}; cast the columns in the query"
        ) from exc
    return table
