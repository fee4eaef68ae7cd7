"""The driver's reader reads the row groups its checks found in the footers (runtime/inputs/parquet_read.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.runtime.inputs.parquet_read import row_group_batches
from airflow_provider_batchinfer.store.inputs import InputError, inspect_input


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


# --- corrupt files: a permanent error naming the file, on every read ---------------------------------


def _good_and_damaged(tmp_path, how):
    from tests.corrupt_inputs import damage

    files = []
    for f in range(3):
        path = tmp_path / f"tickets-{f}.parquet"
        pq.write_table(pa.table({"id": pa.array(range(f * 50, f * 50 + 50), pa.int64()), "text": ["x"] * 50}), path)
        files.append(str(path))
    damage(tmp_path / "tickets-1.parquet", how)
    return files


def _reported(exc):
    """What the runtime's error line says of ``exc`` (its message, whether a retry can help)."""
    from airflow_provider_batchinfer.runtime.reporting import failure

    return failure(exc)


@pytest.mark.parametrize("how", ["truncated", "bad_magic", "tiny", "bad_footer"])
def test_a_file_whose_footer_does_not_read_fails_the_checks_permanently_naming_it(tmp_path, how):
    files = _good_and_damaged(tmp_path, how)
    with pytest.raises(InputError) as caught:
        inspect_input(files, None)
    found = _reported(caught.value)
    assert f"input file {files[1]} is not a readable Parquet file" in found.error, found.error
    assert "truncated or corrupt, and a retry reads the same bytes" in found.error
    assert found.permanent, "a retry reads the same bytes: the task must fail without its retries"
    assert found.type == "CorruptInputError"


def test_pages_that_do_not_decode_fail_the_drivers_reads_permanently_naming_the_file(tmp_path):
    """The footer is intact, so the checks pass; the in-driver engine's reader and the pool's read of
    a small input in its driver each find the damage and name the file."""
    from airflow_provider_batchinfer.runtime.inputs.small_input import read_small_input

    files = _good_and_damaged(tmp_path, "bad_pages")
    assert inspect_input(files, None)[0] == 150
    reads = {
        "in-driver reader": lambda: [t for f in files for t in row_group_batches(f, None, ["id", "text"], [0], 16)],
        "small input read": lambda: read_small_input(files, ["id", "text"], None),
    }
    for what, read in reads.items():
        with pytest.raises(InputError) as caught:
            read()
        found = _reported(caught.value)
        assert f"input file {files[1]} is not a readable Parquet file" in found.error, (what, found.error)
        assert found.permanent, what


def test_a_stores_failure_is_not_taken_for_a_corrupt_file():
    """pyarrow reports an object store's failures as OSError too: those stay retryable."""
    import pyarrow as pa

    from airflow_provider_batchinfer.store.inputs import is_corrupt_parquet

    assert is_corrupt_parquet(pa.ArrowInvalid("Parquet magic bytes not found in footer"))
    assert is_corrupt_parquet(OSError("Couldn't deserialize thrift: No more data to read."))
    for transient in (
        OSError("When reading information for key 'a.parquet' in bucket 'b': AWS Error NETWORK_CONNECTION"),
        OSError("curlCode: 28, Timeout was reached"),
        FileNotFoundError("tickets-1.parquet"),
        PermissionError("tickets-1.parquet"),
    ):
        assert not is_corrupt_parquet(transient), transient
