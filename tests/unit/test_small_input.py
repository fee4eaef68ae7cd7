"""What the actor pool's driver reads itself (``runtime/inputs/small_input.py``): a small input, whole and in
order; nothing past the file or byte limits, counted from the footers and in memory."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_batchinfer.runtime.inputs import small_input
from airflow_provider_batchinfer.runtime.tuning import TUNING


def _files(tmp_path, values: list[list[str]]) -> list[str]:
    files = []
    for n, rows in enumerate(values):
        table = pa.table({"id": pa.array(range(n * 100, n * 100 + len(rows)), pa.int64()), "text": rows})
        pq.write_table(table, tmp_path / f"f{n}.parquet", row_group_size=2)
        files.append(str(tmp_path / f"f{n}.parquet"))
    return files


def test_a_small_input_is_read_whole_in_file_order_with_the_columns_asked(tmp_path):
    files = _files(tmp_path, [["a", "b", "c"], ["d"], ["e", "f"]])
    table = small_input.read_small_input(files, ["text", "id"], None)
    assert table is not None and table.column_names == ["text", "id"]
    assert table.column("id").to_pylist() == [0, 1, 2, 100, 200, 201]
    assert table.schema.field("text").type == pa.string()


def test_too_many_files_or_bytes_leave_the_input_to_the_file_read(tmp_path, monkeypatch):
    files = _files(tmp_path, [[f"{i}" + "a" * 1000 for i in range(4)], [f"{i}" + "b" * 1000 for i in range(4)]])
    shrunk = dataclasses.replace(TUNING, driver_read_files=1)
    monkeypatch.setattr(small_input, "TUNING", shrunk)
    assert small_input.read_small_input(files, ["id", "text"], None) is None
    monkeypatch.setattr(small_input, "TUNING", dataclasses.replace(TUNING, driver_read_bytes=12_000))
    assert small_input.byte_limit() == 12_000
    assert small_input.read_small_input(files, ["id", "text"], None) is None  # the footers: ~17 kB
    assert small_input.read_small_input(files[:1], ["id", "text"], None) is not None
    # a dictionary-encoded column is small in the footer and large in memory: counted as read
    repeated = tmp_path / "repeated.parquet"
    pq.write_table(pa.table({"id": range(100), "text": ["x" * 1000] * 100}), repeated)
    assert pq.ParquetFile(repeated).metadata.row_group(0).total_byte_size < 12_000
    assert small_input.read_small_input([str(repeated)], ["id", "text"], None) is None


def test_the_limit_never_exceeds_one_read_tasks_bytes(monkeypatch):
    monkeypatch.setattr(
        small_input, "TUNING", dataclasses.replace(TUNING, driver_read_bytes=TUNING.read_task_bytes * 2)
    )
    assert small_input.byte_limit() == TUNING.read_task_bytes
