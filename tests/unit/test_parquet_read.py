"""The driver's reader reads the row groups its checks found in the footers (runtime/parquet_read.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_batchinfer.inputs import inspect_input
from airflow_provider_batchinfer.runtime.parquet_read import row_group_batches


def test_the_read_returns_every_row_of_the_row_groups_once_in_order(tmp_path):
    files = []
    for f in range(3):
        table = pa.table({"id": pa.array(range(f * 1000, f * 1000 + 1000), pa.int64()), "x": [0.5] * 1000})
        path = tmp_path / f"part-{f}.parquet"
        pq.write_table(table, path, row_group_size=300)  # 4 row groups: 300, 300, 300, 100
        files.append(str(path))
    rows, schema, groups = inspect_input(files, None)
    assert rows == 3000 and groups == [[300, 300, 300, 100]] * 3 and schema.names == ["id", "x"]
    read = [t for f, path in enumerate(files) for t in row_group_batches(path, None, ["id"], range(4), rows=128)]
    assert all(t.num_rows <= 128 and t.column_names == ["id"] for t in read)
    assert [i for t in read for i in t.column("id").to_pylist()] == list(range(3000))
    # a batch never spans two row groups
    first = list(row_group_batches(files[0], None, ["id", "x"], range(4), rows=1000))
    assert [t.num_rows for t in first] == [300, 300, 300, 100]
