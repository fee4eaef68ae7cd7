"""Checking that ``InputSpec.id_column`` holds every value once, in a fixed amount of memory.

Resuming and dead-lettering identify rows by their id, so a duplicated id must fail the job before
any compute. Holding every id of the input at once (let alone a hash table of them) grows with the
input until the driver runs out of memory. Instead the ids are streamed once, one record batch of
one column at a time, and only a 64-bit hash of each id is kept (``runtime/rows/id_hash.py``): split by
that hash into partitions of about ``Tuning.id_check_rows_per_partition`` hashes, each spilled to its
own file and then sorted alone. Equal values have equal hashes and share a partition, so when no
partition holds a hash twice, the ids are unique. Sorting fixed-width hashes is several times
cheaper than sorting the ids themselves, whatever their type, and this is the path every valid input
takes. An input that fits one partition is checked in memory, without spill files.

Equal hashes mean a duplicated id or, rarely, two ids whose hashes collide. Only then is the exact
check run: the ids themselves are partitioned and spilled the same way and each partition is
sorted, which tells a collision (the input passes) from a duplicate. Either way the error names the
same duplicated id, counted over the whole input.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from airflow_provider_batchinfer.runtime.rows.id_hash import array_values, hashes_repeat, partition_bounds, partition_of
from airflow_provider_batchinfer.runtime.tuning import TUNING

#: rows per record batch read from a file's id column: bounds what one batch holds, whatever the file
READ_BATCH_ROWS = 65_536


@dataclass(frozen=True)
class Duplicates:
    """What a set of ids holds more than once: how many distinct values, and the first of them in
    the order the values first appear (with how many times it appears)."""

    values: int
    example: Any
    example_count: int
    example_index: int  # where the example first appears among the ids that were checked


def check_unique_ids(
    files: list[str],
    id_column: str,
    storage_options: dict[str, Any] | None,
    total_rows: int,
    rows_per_partition: int | None = None,
    spill_dir: str | None = None,
) -> None:
    """Fail (``InputError``) when ``id_column`` is missing from a file, holds nulls, or holds a value
    twice. ``total_rows`` is the input's row count from the Parquet footers: it sizes the partitions.
    ``rows_per_partition`` defaults to ``TUNING.id_check_rows_per_partition``; ``spill_dir`` is
    where the temporary spill directory goes (default: the system's temporary directory)."""
    budget = max(1, rows_per_partition or TUNING.id_check_rows_per_partition)
    partitions = max(1, math.ceil(total_rows / budget))
    nulls, repeat = hashes_repeat(
        len(files), lambda i: _id_arrays([files[i]], id_column, storage_options), partitions, budget, spill_dir
    )
    _refuse_nulls(id_column, nulls)
    if not repeat:
        return
    if partitions == 1:
        found = _in_memory(files, id_column, storage_options)
    else:
        found = _partitioned(files, id_column, storage_options, partitions, budget, spill_dir)
    if found is not None:
        _raise_duplicates(id_column, found)


# --- reading ----------------------------------------------------------------------------------------


def _id_arrays(files: list[str], id_column: str, storage_options: dict[str, Any] | None) -> Iterator[Any]:
    """The id column of every file, in input order, one record batch at a time (dictionaries decoded).

    This is the first read of any page, before either engine's: a file whose footer reads but whose
    pages do not decode fails here, as ``inputs.CorruptInputError`` naming it (permanent), and a
    store's failure as its ``StageError``, as the engines' own reads report them."""
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.store.inputs import InputError, reading_parquet
    from airflow_provider_batchinfer.store.stage import Stage

    for location in files:
        stage = Stage.open(location, storage_options)
        with stage._io("read"), reading_parquet(location), stage.fs.open_input_file(stage.path) as f:
            pf = pq.ParquetFile(f)
            if id_column not in pf.schema_arrow.names:
                raise InputError(
                    f"InputSpec.id_column {id_column!r} is not a column of {location} "
                    f"(columns: {pf.schema_arrow.names})"
                )
            for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=[id_column]):
                ids = batch.column(0)
                yield ids.dictionary_decode() if hasattr(ids, "dictionary_decode") else ids


def _refuse_nulls(id_column: str, nulls: int) -> None:
    if nulls:
        from airflow_provider_batchinfer.store.inputs import InputError

        raise InputError(f"id column {id_column!r} has {nulls} null value(s); every row needs an id")


def _duplicates(ids: Any) -> Duplicates | None:
    """The values ``ids`` (an Arrow array or chunked array without nulls) holds more than once.

    Sorting needs a few copies' worth of the ids, where a hash table of distinct values needs many
    times more; floats (whose NaNs a hash table counts as one value) and types Arrow cannot sort
    are counted in a hash table."""
    import pyarrow as pa

    if not pa.types.is_floating(ids.type):
        try:
            return _duplicates_sorted(ids)
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
            pass
    return _duplicates_hashed(ids)


def _duplicates_sorted(ids: Any) -> Duplicates | None:
    """Equal values are neighbours once sorted; the sort is stable, so each run of equal values
    starts with the value's first row, which picks the example a hash table's order would."""
    import numpy as np
    import pyarrow.compute as pc

    if len(ids) < 2:
        return None
    order = pc.sort_indices(ids)
    ranked = ids.take(order)
    same = _bools(pc.equal(ranked.slice(1), ranked.slice(0, len(ids) - 1)))  # same[i]: rank i+1 == rank i
    if not same.any():
        return None
    starts = np.flatnonzero(same & ~np.concatenate([[False], same[:-1]]))  # the first rank of each run
    first_rows = array_values(order, "u8")[starts]
    pick = int(np.argmin(first_rows))
    ends = np.flatnonzero(~same[starts[pick] :])  # the run's last rank, relative to its first
    count = int(ends[0]) + 1 if len(ends) else len(same) - int(starts[pick]) + 1
    return Duplicates(len(starts), ranked[int(starts[pick])].as_py(), count, int(first_rows[pick]))


def _duplicates_hashed(ids: Any) -> Duplicates | None:
    import pyarrow.compute as pc

    if pc.count_distinct(ids).as_py() == len(ids):
        return None
    counts = pc.value_counts(ids)  # in the order the values first appear
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    example = dup[0]
    index = pc.index(ids, example["values"]).as_py()
    return Duplicates(len(dup), example["values"].as_py(), example["counts"].as_py(), index)


def _bools(mask: Any) -> Any:
    """A boolean Arrow (chunked) array without nulls as a numpy bool array."""
    import numpy as np
    import pyarrow as pa

    if isinstance(mask, pa.ChunkedArray):
        mask = mask.combine_chunks() if mask.num_chunks else pa.array([], pa.bool_())
    bits = np.frombuffer(mask.buffers()[1], dtype=np.uint8) if len(mask) else np.zeros(0, np.uint8)
    return np.unpackbits(bits, bitorder="little")[mask.offset : mask.offset + len(mask)].astype(bool)


def _raise_duplicates(id_column: str, found: Duplicates) -> None:
    from airflow_provider_batchinfer.store.inputs import InputError

    raise InputError(
        f"id column {id_column!r} is not unique: {found.values} value(s) appear more than once (e.g. "
        f"{found.example!r} appears {found.example_count} times); deduplicate in data_prep "
        "or choose another InputSpec.id_column"
    )


def _in_memory(files: list[str], id_column: str, storage_options: dict[str, Any] | None) -> Duplicates | None:
    """The whole id column at once: for inputs that fit one partition."""
    import pyarrow as pa

    chunks = list(_id_arrays(files, id_column, storage_options))
    ids = pa.chunked_array(chunks)
    _refuse_nulls(id_column, ids.null_count)
    return _duplicates(ids)


# --- partitioning -----------------------------------------------------------------------------------


def _partitioned(
    files: list[str],
    id_column: str,
    storage_options: dict[str, Any] | None,
    partitions: int,
    budget: int,
    spill_dir: str | None,
) -> Duplicates | None:
    """Spill the ids into ``partitions`` files by hash, then check each file alone. Every partition
    is checked, so the error counts every duplicated value; the example is the duplicated value that
    appears first in the input, as the in-memory check names it."""
    with tempfile.TemporaryDirectory(prefix="batchinfer-ids-", dir=spill_dir) as tmp:
        nulls = _spill(_id_arrays(files, id_column, storage_options), partitions, budget, tmp)
        _refuse_nulls(id_column, nulls)
        per_partition: dict[int, Duplicates] = {}
        for p in range(partitions):
            path = os.path.join(tmp, f"{p}.arrows")
            if os.path.exists(path) and (found := _duplicates(_read_spill(path))) is not None:
                per_partition[p] = found
    if not per_partition:
        return None
    first = per_partition[next(iter(per_partition))]
    if len(per_partition) > 1:  # which partition's example appears first in the input
        rows = _input_rows_of(
            _id_arrays(files, id_column, storage_options),
            partitions,
            {p: d.example_index for p, d in per_partition.items()},
        )
        first = per_partition[min(rows, key=lambda p: rows[p])]
    total = sum(d.values for d in per_partition.values())
    return Duplicates(total, first.example, first.example_count, first.example_index)


def _spill(arrays: Iterator[Any], partitions: int, budget: int, tmp: str) -> int:
    """Append each id to its partition's IPC stream file; the null ids seen (none are spilled once a
    null is seen: the check fails on them). Ids wait in memory until ``budget`` of them are held,
    then every partition's waiting ids are written as one record batch."""
    import pyarrow as pa

    writers: dict[int, Any] = {}
    waiting: dict[int, list[Any]] = {}
    held = nulls = 0

    def flush() -> None:
        for p, chunks in waiting.items():
            if p not in writers:
                schema = pa.schema([pa.field("id", chunks[0].type)])
                writers[p] = pa.ipc.new_stream(pa.OSFile(os.path.join(tmp, f"{p}.arrows"), "wb"), schema)
            writers[p].write_batch(pa.record_batch([pa.concat_arrays(chunks)], names=["id"]))
        waiting.clear()

    try:
        for ids in arrays:
            nulls += ids.null_count
            if nulls or not len(ids):
                continue
            parts = partition_of(ids, partitions)
            order = parts.argsort(kind="stable")
            grouped = ids.take(pa.array(order))
            bounds = partition_bounds(parts, partitions)
            for p in range(partitions):
                if bounds[p + 1] > bounds[p]:
                    waiting.setdefault(p, []).append(grouped.slice(bounds[p], bounds[p + 1] - bounds[p]))
            held += len(ids)
            if held >= budget:
                flush()
                held = 0
        flush()
    finally:
        for writer in writers.values():
            writer.close()
    return nulls


def _read_spill(path: str) -> Any:
    import pyarrow as pa

    with pa.OSFile(path, "rb") as f:
        return pa.ipc.open_stream(f).read_all().column(0)


def _input_rows_of(arrays: Iterator[Any], partitions: int, local: dict[int, int]) -> dict[int, int]:
    """For each partition, the input row of its ``local[p]``-th id: the spill files keep the input's
    order, so the row is found by counting each partition's ids again, batch by batch."""
    import numpy as np

    seen = np.zeros(partitions, dtype=np.int64)
    rows: dict[int, int] = {}
    offset = 0
    for ids in arrays:
        parts = partition_of(ids, partitions)
        counts = np.bincount(parts, minlength=partitions)
        for p, k in local.items():
            if p not in rows and seen[p] + counts[p] > k:
                rows[p] = offset + int(np.flatnonzero(parts == p)[k - seen[p]])
        if len(rows) == len(local):
            break
        seen += counts
        offset += len(ids)
    return rows


def check_input_ids(
    files: list[str],
    id_column: str,
    storage_options: dict[str, Any] | None,
    total_rows: int,
    rows_per_partition: int | None = None,
) -> float:
    """Fail before any compute when ``id_column`` is missing, null or holds a value twice: resuming
    and dead-lettering both identify rows by it. Reads only that one column, and holds at most
    ``Tuning.id_check_rows_per_partition`` ids at once (``total_rows``, from the footers, sizes the
    partitions it spills: :func:`check_unique_ids`). Returns the seconds it took, for the manifest's
    ``timings.id_check_s``."""
    import time

    import pyarrow as pa

    started = time.monotonic()
    try:
        check_unique_ids(files, id_column, storage_options, total_rows, rows_per_partition)
    finally:  # Arrow keeps the pages its Parquet reads freed for reuse; the job's pipeline comes next
        pa.default_memory_pool().release_unused()
    seconds = round(time.monotonic() - started, 3)
    print(f"[batchinfer] input: {total_rows:,} ids of {id_column!r} checked unique in {seconds:.3f} s", flush=True)
    return seconds
