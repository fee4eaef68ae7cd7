"""A SQL input, materialized to Parquet in chunks through the connection's own DB-API hook.

The query's result never sits in memory whole: rows are fetched ``chunk_rows`` at a time and each
chunk becomes one ``_input/part-NNNNN.parquet`` in the run directory, which the job then reads like
any Parquet input.
"""

from __future__ import annotations

from contextlib import closing
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

if TYPE_CHECKING:
    from airflow_provider_batchinfer.launchers.base import TaskLog
    from airflow_provider_batchinfer.stage import Stage


def _chunk_table(names: list[str], rows: list[tuple[Any, ...]], schema: Any, first_row: int) -> Any:
    """One chunk as a ``pyarrow.Table``, cast to the first chunk's schema."""
    import pyarrow as pa

    columns = list(zip(*rows, strict=False))
    try:
        table = pa.table({n: pa.array(list(c)) for n, c in zip(names, columns, strict=False)})
        if schema is not None and not table.schema.equals(schema):
            table = table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise AirflowFailException(
            f"the input query's rows {first_row}-{first_row + len(rows) - 1} have types that do not fit "
            f"{schema}: {exc}; cast the columns in the query"
        ) from exc
    return table


def materialize_sql(conn_id: str, sql: str, target: Stage, chunk_rows: int, log: TaskLog) -> int:
    """Run ``sql`` on the Airflow connection ``conn_id`` and write its result below ``target``;
    returns the number of rows. Fails the task (no retry) for a non-SQL connection, a statement
    without a result set, an empty result, or rows whose types do not fit the first chunk's."""
    import pyarrow.parquet as pq
    from airflow.sdk import BaseHook

    db_hook = BaseHook.get_connection(conn_id).get_hook()
    if not hasattr(db_hook, "get_conn"):
        raise AirflowFailException(f"connection {conn_id!r} is not a SQL connection (its hook has no get_conn)")
    log.info("Materializing the query on %s into %s", conn_id, target.location)
    rows_total = 0
    part = 0
    schema = None
    with closing(db_hook.get_conn()) as conn, closing(conn.cursor()) as cursor:
        cursor.execute(sql)
        if cursor.description is None:
            raise AirflowFailException("the input query returned no result set; it must be a SELECT")
        names = [d[0] for d in cursor.description]
        while rows := cursor.fetchmany(chunk_rows):
            table = _chunk_table(names, rows, schema, rows_total + 1)
            schema = schema or table.schema
            out = target.child(f"part-{part:05d}.parquet")
            out.fs.create_dir(target.path, recursive=True)
            with out.fs.open_output_stream(out.path) as sink:
                pq.write_table(table, sink, compression="zstd")
            rows_total += len(rows)
            part += 1
    if rows_total == 0:
        raise AirflowFailException(f"the input query on {conn_id!r} returned no rows; nothing to score")
    log.info("Materialized %d rows in %d part(s)", rows_total, part)
    return rows_total
