"""Incremental scoring's key match (``runtime/incremental/match.py``): hash-partitioned spill files, one
partition at a time, equal to a plain in-memory lookup. About 1 s."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.runtime.incremental.keys import (
    KEY_COLUMN,
    SOURCE_PART_COLUMN,
    SOURCE_ROW_COLUMN,
    ReuseIndexError,
    key_array,
    row_keys,
)
from airflow_provider_batchinfer.runtime.incremental.match import ReuseMatch
from airflow_provider_batchinfer.store.stage import Stage

CONTEXT = "ab" * 32
BUDGET = 50


def _key_files(tmp_path, parts):
    """One key file per part (as the keyed datasink writes them), as ``Source.key_files`` lists them."""
    files = []
    for number, texts in enumerate(parts):
        keys = key_array(row_keys(pa.table({"text": texts}), ["text"], CONTEXT))
        path = tmp_path / f"part-{number}.keys.parquet"
        pq.write_table(pa.table({"key": keys, "reused": pa.array([False] * len(texts))}), path, row_group_size=70)
        files.append((number, str(path), len(texts), hashlib.sha256(path.read_bytes()).hexdigest()))
    return files


def _inputs(tmp_path, files):
    out = []
    for number, texts in enumerate(files):
        path = tmp_path / f"in-{number}.parquet"
        table = pa.table({"id": [f"{number}-{i}" for i in range(len(texts))], "text": texts})
        pq.write_table(table, path, row_group_size=90)
        out.append(str(path))
    return out


def test_the_partitioned_match_equals_a_dict_lookup_while_holding_a_few_partitions(tmp_path):
    # 1,200 earlier keys (with repeats) and 1,000 input rows, against a budget of 50 rows a partition
    earlier = [[f"row {(p * 400 + i) % 1100}" for i in range(400)] for p in range(3)]
    given = [[f"row {i * 3}" if i % 4 else f"new {i}" for i in range(f * 500, f * 500 + 500)] for f in range(2)]
    key_files, files = _key_files(tmp_path, earlier), _inputs(tmp_path, given)
    where: dict[bytes, tuple[int, int]] = {}
    for part, texts in enumerate(earlier):  # the plain lookup: the first place of each key
        raw = row_keys(pa.table({"text": texts}), ["text"], CONTEXT)
        for row in range(len(texts)):
            where.setdefault(raw[row * 16 : row * 16 + 16], (part, row))

    with ReuseMatch(CONTEXT, ["text"], None, rows_per_partition=BUDGET, spill_dir=str(tmp_path)) as matcher:
        found = matcher.match(key_files, files, 1000)
        copies = matcher.write_keyed(files, ["id", "text"], Stage.open(str(tmp_path / "keyed")))

    assert matcher.partitions == 24  # ceil(1,200 / 50)
    assert matcher.largest <= 4 * BUDGET < 2200  # one partition of both runs at a time, never all
    expected_found = 0
    for texts, copy in zip(given, copies, strict=True):
        table = pq.read_table(copy)
        assert table.column_names == ["id", "text", KEY_COLUMN, SOURCE_PART_COLUMN, SOURCE_ROW_COLUMN]
        assert table.column("text").to_pylist() == texts  # today's rows, in their order
        raw = row_keys(pa.table({"text": texts}), ["text"], CONTEXT)
        assert b"".join(table.column(KEY_COLUMN).to_pylist()) == raw  # the key function, byte for byte
        want = [where.get(raw[i * 16 : i * 16 + 16], (-1, 0)) for i in range(len(texts))]
        parts, rows = table.column(SOURCE_PART_COLUMN).to_pylist(), table.column(SOURCE_ROW_COLUMN).to_pylist()
        got = list(zip(parts, rows, strict=True))
        assert got == want
        expected_found += sum(p >= 0 for p, _ in want)
    assert found == expected_found == 275  # "row 3i" for 3i < 1,100 (367 rows), less every fourth (new)


def test_a_key_file_that_fails_its_checks_is_refused(tmp_path):
    key_files = _key_files(tmp_path, [["a", "b"], ["c"]])
    files = _inputs(tmp_path, [["a", "c"]])
    part, location, _rows, sha256 = key_files[1]
    with (
        ReuseMatch(CONTEXT, ["text"], None, rows_per_partition=BUDGET) as matcher,
        pytest.raises(ReuseIndexError, match="holds 1 keys but the earlier run's _SUCCESS says 2"),
    ):
        matcher.match([key_files[0], (part, location, 2, sha256)], files, 2)
    with open(location, "ab") as f:
        f.write(b"x")
    with (
        ReuseMatch(CONTEXT, ["text"], None, rows_per_partition=BUDGET) as matcher,
        pytest.raises(ReuseIndexError, match="part-1.keys.parquet does not match its sha256"),
    ):
        matcher.match(key_files, files, 2)
