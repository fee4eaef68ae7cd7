"""A SQL input as the job file names it: the query and how the job reads it, never the database's
address or credentials.

The operator resolves the Airflow connection into a SQLAlchemy URL and hands it to the job the way
its storage credentials travel (the launcher's secret environment, :data:`SQL_URL_ENV`): the URL
may hold a password, so it is never in ``_job.json``, the Ray job's entrypoint, ``runtime_env`` or
metadata, the manifest or a log line. The job reads the query (``runtime/inputs/sql_input.py``).
Imports neither side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_batchinfer.contract._fields import _get, _opt
from airflow_provider_batchinfer.contract.layout import ContractError

#: the job's environment variable that holds the database's SQLAlchemy URL (a secret)
SQL_URL_ENV = "BATCHINFER_SQL_URL"


@dataclass(frozen=True)
class SqlInput:
    """The query a job reads into its ``_input/<attempt>/``.

    ``conn_id``: the Airflow connection it runs on (a name for messages; the URL is not here).
    ``chunk_rows``: rows fetched at a time, and the most rows per Parquet file, when the driver
    streams the result. ``shard_column``: a column the database can hash, to read the query in
    shards on Ray (``ray.data.read_sql``); ``shard_hash_fn``: the SQL function that hashes it
    (``MD5`` by default; an empty string uses the column's value, for an integer column).
    ``kept_digest``: for a ``SaveMode.RESUME`` attempt, the digest of the result the kept parts
    were scored from (``identity.materialized_digest``): when this attempt's result differs, the
    kept parts are dropped and every row is scored from the new result."""

    query: str
    conn_id: str
    chunk_rows: int = 100_000
    shard_column: str | None = None
    shard_hash_fn: str = "MD5"
    kept_digest: str | None = None

    def __post_init__(self) -> None:
        if not self.query.strip():
            raise ContractError("sql_input.query is empty")
        if self.chunk_rows < 1:
            raise ContractError(f"sql_input.chunk_rows must be >= 1, got {self.chunk_rows}")
        for name, value in (("shard_column", self.shard_column or ""), ("shard_hash_fn", self.shard_hash_fn)):
            if not all(c.isalnum() or c in "_." for c in value):
                raise ContractError(f"sql_input.{name} {value!r} must be a plain SQL name (letters, digits, _ and .)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "conn_id": self.conn_id,
            "chunk_rows": self.chunk_rows,
            "shard_column": self.shard_column,
            "shard_hash_fn": self.shard_hash_fn,
            "kept_digest": self.kept_digest,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "sql_input") -> SqlInput:
        err = ContractError
        return cls(
            query=_get(data, "query", str, where, err),
            conn_id=_get(data, "conn_id", str, where, err),
            chunk_rows=_opt(data, "chunk_rows", int, where, err, 100_000),
            shard_column=_opt(data, "shard_column", str, where, err),
            shard_hash_fn=_opt(data, "shard_hash_fn", str, where, err, "MD5"),
            kept_digest=_opt(data, "kept_digest", str, where, err),
        )
