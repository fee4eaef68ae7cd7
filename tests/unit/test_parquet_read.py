"""Planning the pool's reads from the footers the driver read, and reading them (runtime/parquet_read.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_batchinfer.inputs import inspect_input
from airflow_provider_batchinfer.runtime.parquet_read import (
    MAX_READ_TASKS,
    _read_run,
    read_tasks,
    row_group_batches,
    split_row_groups,
)
from airflow_provider_batchinfer.runtime.tuning import TUNING


def test_a_small_input_is_one_read_task_and_a_large_one_spreads_over_its_row_groups():
    assert read_tasks([[100], [100]], row_bytes=40.0) == 1  # 8 KB: one worker process, not two
    assert read_tasks([[0], [0, 0]], row_bytes=40.0) == 1
    big_rows = TUNING.read_task_bytes // 100  # each row group holds one task's worth of bytes
    assert read_tasks([[big_rows] * 3, [big_rows] * 2], row_bytes=100.0) == 5
    assert read_tasks([[big_rows * 10]], row_bytes=100.0) == 1  # no finer than a row group
    assert read_tasks([[big_rows]] * (MAX_READ_TASKS + 5), row_bytes=100.0) == MAX_READ_TASKS


def test_row_groups_are_split_into_runs_of_about_equal_rows_in_order():
    runs = split_row_groups([[10, 10], [0, 10], [10]], tasks=2)
    assert runs == [[(0, 0, 10), (0, 1, 10)], [(1, 1, 10), (2, 0, 10)]]  # the empty row group is skipped
    assert split_row_groups([[5, 5, 5]], tasks=10) == [[(0, 0, 5)], [(0, 1, 5)], [(0, 2, 5)]]
    assert split_row_groups([[7]], tasks=4) == [[(0, 0, 7)]]
    assert split_row_groups([[0]], tasks=4) == []
    every = [unit for run in split_row_groups([[3, 4], [5], [6, 7, 8]], tasks=3) for unit in run]
    assert every == [(0, 0, 3), (0, 1, 4), (1, 0, 5), (2, 0, 6), (2, 1, 7), (2, 2, 8)]


def test_the_read_returns_every_row_of_the_planned_row_groups_once(tmp_path):
    files = []
    for f in range(3):
        table = pa.table({"id": pa.array(range(f * 1000, f * 1000 + 1000), pa.int64()), "x": [0.5] * 1000})
        path = tmp_path / f"part-{f}.parquet"
        pq.write_table(table, path, row_group_size=300)  # 4 row groups: 300, 300, 300, 100
        files.append(str(path))
    rows, schema, groups = inspect_input(files, None)
    assert rows == 3000 and groups == [[300, 300, 300, 100]] * 3 and schema.names == ["id", "x"]
    read = [t for run in split_row_groups(groups, tasks=4) for t in _read_run(files, None, ["id"], 128, run)]
    assert all(t.num_rows <= 128 and t.column_names == ["id"] for t in read)
    assert sorted(i for t in read for i in t.column("id").to_pylist()) == list(range(3000))
    # the driver's reader: one file's row groups, in order
    first = list(row_group_batches(files[0], None, ["id", "x"], range(4), rows=1000))
    assert [t.num_rows for t in first] == [300, 300, 300, 100]
