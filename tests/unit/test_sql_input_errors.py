"""The job's own read of a SQL input refuses what cannot be scored, saying why, and writes nothing
half: a statement with no result set, chunks whose types change; a query with no rows writes no
file (what ``InputSpec.on_empty`` then does: tests/component/test_empty_input.py)."""

from __future__ import annotations

import sqlite3

import pytest

from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV, SqlInput
from airflow_provider_batchinfer.runtime.inputs import sql_input
from airflow_provider_batchinfer.store.stage import Stage


@pytest.fixture
def database(tmp_path, monkeypatch):
    path = tmp_path / "db.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (id INTEGER, v)")
        conn.executemany("INSERT INTO t VALUES (?, ?)", [(1, 1.5), (2, 2.5), (3, "three")])
    monkeypatch.setenv(SQL_URL_ENV, f"sqlite:///{path}")
    return path


def _dest(tmp_path) -> Stage:
    dest = Stage.open(str(tmp_path / "out"))
    dest.fs.create_dir(dest.path, recursive=True)
    return dest


def test_a_statement_without_a_result_set_is_refused(database, tmp_path):
    with pytest.raises(sql_input.SqlInputError, match="returned no result set; it must be a SELECT"):
        sql_input.stream(SqlInput("UPDATE t SET v = 0 WHERE id = 99", "db"), _dest(tmp_path))


def test_chunks_whose_types_change_are_refused_with_their_rows(database, tmp_path):
    ref = SqlInput("SELECT id, v FROM t ORDER BY id", "db", chunk_rows=2)
    with pytest.raises(sql_input.SqlInputError, match=r"(?s)rows 3-3 have types that do not fit .*cast the columns"):
        sql_input.stream(ref, _dest(tmp_path))


def test_a_query_with_no_rows_writes_nothing(database, tmp_path):
    rows, files = sql_input.stream(SqlInput("SELECT id FROM t WHERE id > 99", "db"), _dest(tmp_path))
    assert (rows, files) == (0, 0) and list((tmp_path / "out").iterdir()) == []
