"""The id column's uniqueness check (runtime/rows/unique_ids.py) on its own: partitioned and in-memory
checks agree, name the same duplicated id, refuse nulls and missing columns, leave no spill file,
and the partitioned one holds a fixed amount of memory. Local Parquet files only: no Ray."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import Manifest
from airflow_provider_batchinfer.runtime.rows import id_hash, unique_ids
from airflow_provider_batchinfer.runtime.rows.unique_ids import check_input_ids
from airflow_provider_batchinfer.runtime.tuning import TUNING
from airflow_provider_batchinfer.store.inputs import InputError
from tests.runs import manifest_for

ROWS = 10_000
BUDGET = 500  # 20 partitions for 10k rows


def _write(directory: Path, ids: Any, files: int = 4) -> list[str]:
    """``ids`` (a list or numpy array) split over ``files`` Parquet files, with a second column."""
    directory.mkdir(parents=True, exist_ok=True)
    column = pa.array(ids)
    out = []
    for i, bounds in enumerate(np.array_split(np.arange(len(column)), files)):
        part = column.slice(int(bounds[0]), len(bounds)) if len(bounds) else column.slice(0, 0)
        path = directory / f"part-{i:02d}.parquet"
        pq.write_table(pa.table({"id": part, "x": pa.array(np.zeros(len(part)))}), path, row_group_size=1_000)
        out.append(str(path))
    return out


def _ids(kind: str, values: Any) -> Any:
    values = np.asarray(values, dtype=np.int64)
    return values if kind == "int64" else [f"ticket-{v:08d}" for v in values]


def _message(files: list[str], budget: int, spill_dir: str | None = None) -> str | None:
    try:
        unique_ids.check_unique_ids(files, "id", None, ROWS, rows_per_partition=budget, spill_dir=spill_dir)
    except InputError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind", ["int64", "string"])
@pytest.mark.parametrize("budget", [BUDGET, ROWS])
def test_unique_ids_pass(tmp_path, kind, budget):
    files = _write(tmp_path / "in", _ids(kind, np.random.default_rng(1).permutation(ROWS)))
    assert _message(files, budget) is None


def _with_duplicates(where: str) -> np.ndarray:
    ids = np.arange(ROWS, dtype=np.int64)
    if where == "within a file":
        ids[10] = ids[20] = 4242  # both in the first file
    elif where == "across files":
        ids[5], ids[ROWS - 5] = 777, 777  # first file and last file
    else:  # many values, in many partitions: the example is the one that appears first
        ids[ROWS // 2 :: 97] = np.arange(7, 7 + len(ids[ROWS // 2 :: 97]) * 31, 31)
    return ids


@pytest.mark.parametrize("kind", ["int64", "string"])
@pytest.mark.parametrize("where", ["within a file", "across files", "many values"])
def test_duplicates_are_named_exactly_as_the_in_memory_check_names_them(tmp_path, kind, where):
    ids = _with_duplicates(where)
    files = _write(tmp_path / "in", _ids(kind, ids))
    values, counts = np.unique(ids, return_counts=True)
    dup = values[counts > 1]
    first = next(v for v in ids if v in set(dup.tolist()))
    example = int(first) if kind == "int64" else f"ticket-{first:08d}"
    expected = (
        f"id column 'id' is not unique: {len(dup)} value(s) appear more than once (e.g. {example!r} appears "
        f"{counts[values == first][0]} times); deduplicate in data_prep or choose another InputSpec.id_column"
    )
    assert _message(files, ROWS) == expected  # in memory: one hash table, as the check always did
    assert _message(files, BUDGET) == expected  # 20 spilled partitions
    if where == "many values":  # the duplicates sit in several partitions: the example is still the first
        partitions = id_hash.partition_of(pa.array(_ids(kind, dup)), math.ceil(ROWS / BUDGET))
        assert len(set(partitions.tolist())) > 5
        assert partitions[0] != partitions.min()  # the first duplicate is not in the first partition checked


@pytest.mark.parametrize("budget", [BUDGET, ROWS])
def test_null_ids_are_refused_with_their_count_over_all_files(tmp_path, budget):
    ids: list[Any] = list(range(ROWS))
    ids[3] = ids[ROWS // 2] = ids[ROWS - 1] = None
    files = _write(tmp_path / "in", ids)
    assert _message(files, budget) == "id column 'id' has 3 null value(s); every row needs an id"


@pytest.mark.parametrize("budget", [BUDGET, ROWS])
def test_a_file_without_the_id_column_is_named(tmp_path, budget):
    files = _write(tmp_path / "in", list(range(ROWS - 10)))
    other = tmp_path / "in" / "other.parquet"
    pq.write_table(pa.table({"ticket": list(range(10))}), other)
    message = _message([*files, str(other)], budget)
    assert message == f"InputSpec.id_column 'id' is not a column of {other} (columns: ['ticket'])"


@pytest.mark.parametrize("budget", [BUDGET, ROWS])
def test_pages_that_do_not_decode_are_named_as_a_corrupt_file(tmp_path, budget):
    """The footer reads (the row count and schema checks pass), the pages do not: the check is the
    first read of any page, so its error names the file and is permanent, as the engines' reads are."""
    from airflow_provider_batchinfer.runtime.reporting import failure
    from airflow_provider_batchinfer.store.inputs import CorruptInputError
    from tests.corrupt_inputs import damage

    files = _write(tmp_path / "in", list(range(ROWS)))
    damage(Path(files[2]), "bad_pages")
    with pytest.raises(CorruptInputError) as caught:
        unique_ids.check_unique_ids(files, "id", None, ROWS, rows_per_partition=budget, spill_dir=str(tmp_path))
    found = failure(caught.value)
    assert found.error.startswith(f"CorruptInputError: input file {files[2]} is not a readable Parquet file ("), found
    assert found.permanent
    assert [p.name for p in tmp_path.iterdir()] == ["in"], "a spill directory was left behind"


@pytest.mark.parametrize("where", ["unique", "duplicate", "null"])
def test_spill_files_are_removed_afterwards(tmp_path, monkeypatch, where):
    """A valid input is decided by the hashes alone; a duplicate sends the ids through the exact
    check too. Every spill file of either pass is under ``spill_dir`` and gone afterwards."""
    ids: list[Any] = list(range(ROWS))
    if where == "duplicate":
        ids[1] = ids[ROWS - 1] = 99
    elif where == "null":
        ids[ROWS - 1] = None
    files = _write(tmp_path / "in", ids)
    spill = tmp_path / "spill"
    spill.mkdir()
    read: dict[str, list[str]] = {"hashes": [], "ids": []}
    for module, name, kind in ((id_hash, "_read_hashes", "hashes"), (unique_ids, "_read_spill", "ids")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *args, real=real, kind=kind: (read[kind].append(args[0]), real(*args))[1]
        )
    message = _message(files, BUDGET, spill_dir=str(spill))
    assert (message is None) == (where == "unique")
    partitions = math.ceil(ROWS / BUDGET)
    hashed = partitions * min(
        4, len(os.sched_getaffinity(0)), id_hash.MAX_THREADS
    )  # a thread per core, smaller partitions
    if where == "unique":
        assert len(read["hashes"]) == hashed and read["ids"] == []
    elif where == "duplicate":  # the hash pass stops at the partition with the repeat
        assert 1 <= len(read["hashes"]) <= hashed and len(read["ids"]) == partitions
    else:  # a null stops the spilling: there is nothing to check
        assert read == {"hashes": [], "ids": []}
    assert all(p.startswith(str(spill)) for paths in read.values() for p in paths)
    assert os.listdir(spill) == []


@pytest.mark.parametrize("budget", [BUDGET, ROWS])
def test_distinct_ids_whose_hashes_collide_pass_and_a_duplicate_among_them_is_named(tmp_path, monkeypatch, budget):
    """A hash that sends every id to one of 7 values (as a 64-bit hash does once in ~10^19 pairs):
    the hashes repeat, so the exact check runs, and it alone decides."""
    import numpy as np

    monkeypatch.setattr(id_hash, "hash_ids", lambda ids: (np.asarray(ids.to_numpy()) % 7).astype(np.uint64))
    files = _write(tmp_path / "in", list(range(ROWS)))
    assert _message(files, budget) is None
    ids = list(range(ROWS))
    ids[5] = ids[9_000] = 99_999
    expected = (
        "id column 'id' is not unique: 1 value(s) appear more than once (e.g. 99999 appears 2 times); "
        "deduplicate in data_prep or choose another InputSpec.id_column"
    )
    assert _message(_write(tmp_path / "dup", ids), budget) == expected


def test_an_input_that_fits_one_partition_spills_nothing(tmp_path, monkeypatch):
    files = _write(tmp_path / "in", list(range(ROWS)))

    def no_spill(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an input within the budget is checked in memory")

    monkeypatch.setattr(unique_ids.tempfile, "TemporaryDirectory", no_spill)
    assert _message(files, ROWS) is None


def test_the_check_returns_its_seconds_and_logs_them(tmp_path, capsys):
    files = _write(tmp_path / "in", list(range(ROWS)))
    seconds = check_input_ids(files, "id", None, ROWS, rows_per_partition=BUDGET)
    assert isinstance(seconds, float) and seconds >= 0
    assert f"[batchinfer] input: {ROWS:,} ids of 'id' checked unique in {seconds:.3f} s" in capsys.readouterr().out
    assert TUNING.id_check_rows_per_partition > 0


@pytest.mark.parametrize(
    "values",
    [
        pa.array(np.arange(3_000) % 701),
        pa.array((np.arange(3_000) % 701).astype(np.int32)),
        pa.array((np.arange(3_000) % 701).astype(np.uint64)),
        pa.array([f"k{'x' * (i % 40)}{i % 53}" for i in range(3_000)]),
        pa.array([("" if i % 5 else f"v{i % 7}") for i in range(3_000)], pa.large_string()),
        pa.array([bytes([i % 256, i % 3]) for i in range(3_000)], pa.binary(2)),
        pa.array([float(i % 17) for i in range(2_997)] + [0.0, -0.0, float("nan")]),
        pa.array((np.arange(3_000) % 101).astype("datetime64[ms]")),
        pa.array([[i % 4, 1] for i in range(3_000)]),
    ],
    ids=lambda v: str(v.type),
)
def test_equal_ids_fall_in_the_same_partition_whatever_the_batch(values):
    whole = id_hash.partition_of(values, 13)
    batches = np.concatenate([id_hash.partition_of(values.slice(i, 77), 13) for i in range(0, len(values), 77)])
    assert (whole == batches).all()
    seen: dict[Any, int] = {}
    for value, part in zip(values.to_pylist(), whole.tolist(), strict=True):
        key = "nan" if value != value else repr(value) if isinstance(value, list) else value
        assert seen.setdefault(key, part) == part  # 0.0 == -0.0: one key, one partition
    assert len(set(whole.tolist())) > 1 or len(seen) < 4


# --- memory ------------------------------------------------------------------------------------------

_PEAK = textwrap.dedent(
    """
    import json, sys, tracemalloc
    import pyarrow as pa, pyarrow.parquet as pq
    from airflow_provider_batchinfer.runtime.rows.unique_ids import check_input_ids
    files, rows, budget, tiny = json.loads(sys.argv[1])
    pq.write_table(pa.table({"id": list(range(10))}), tiny)
    check_input_ids([tiny], "id", None, 10, rows_per_partition=3)  # what the check imports lazily
    tracemalloc.start()  # numpy's arrays; Arrow's own allocations are in its pool's peak
    check_input_ids(files, "id", None, rows, rows_per_partition=budget)
    print(pa.default_memory_pool().max_memory() + tracemalloc.get_traced_memory()[1])
    """
)


def test_the_partitioned_check_holds_a_fixed_amount_of_memory(tmp_path):
    """2M int64 ids in 10 files with 40k ids per partition: the peak (Arrow's pool and numpy, in a
    fresh process) stays far under what one hash table of 2M ids takes."""
    rows = 2_000_000
    files = _write(tmp_path / "in", np.random.default_rng(2).permutation(rows), files=10)
    args = json.dumps([files, rows, 40_000, str(tmp_path / "tiny.parquet")])
    done = subprocess.run([sys.executable, "-c", _PEAK, args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split()[-1])
    assert peak < 24 << 20, f"peak {peak / 2**20:.1f} MiB"


# --- the manifest ------------------------------------------------------------------------------------


def test_the_manifest_carries_the_check_s_seconds_and_older_ones_read_without_them():
    base = manifest_for("/stage/run1", ())
    timed = dataclasses.replace(base, timings={"total_s": 9.0, "id_check_s": 1.25})
    again = Manifest.from_json(timed.to_json())
    assert again == timed and again.id_check_s == 1.25
    assert json.loads(timed.to_json())["timings"]["id_check_s"] == 1.25
    no_id_column = dataclasses.replace(base, timings={"total_s": 9.0, "id_check_s": None})
    assert Manifest.from_json(no_id_column.to_json()).id_check_s is None
    older = base.to_dict()
    older["timings"] = {"total_s": 9.0}  # written before the check was timed
    assert Manifest.from_dict(older).id_check_s is None
