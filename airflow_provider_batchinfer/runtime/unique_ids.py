"""Checking that ``InputSpec.id_column`` holds every value once, in a fixed amount of memory.

Resuming and dead-lettering identify rows by their id, so a duplicated id must fail the job before
any compute. Holding every id of the input at once (let alone a hash table of them) grows with the
input until the driver runs out of memory. Instead the ids are streamed once, one record batch of
one column at a time, and split by a stable hash of their value into partitions of about
``Tuning.id_check_rows_per_partition`` rows; each partition is spilled to its own Arrow IPC stream
file and then checked alone, by sorting it. Equal values always share a partition, so a partition
without duplicates proves its values unique in the whole input. An input that fits one partition is
checked in memory, without spill files. Either way the error names the same duplicated id, counted
over the whole input.

The hash only has to send equal values to the same partition and spread distinct ones evenly: it is
a vectorised numpy hash of the value's bits (integers, temporals, floats with ``-0.0``/NaN made
equal), of its bytes (strings, binary, decimals), or Python's ``hash`` of the value for any other
type (slower, but still correct).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from airflow_provider_batchinfer.runtime.tuning import TUNING

#: rows per record batch read from a file's id column: bounds what one batch holds, whatever the file
READ_BATCH_ROWS = 65_536
#: bytes of string/binary ids hashed at once: the hash's temporaries are 8 bytes per byte of input
HASH_SLICE_BYTES = 1 << 20

_M1, _M2, _M3 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


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
    if total_rows <= budget:
        found = _in_memory(files, id_column, storage_options)
    else:
        found = _partitioned(files, id_column, storage_options, math.ceil(total_rows / budget), budget, spill_dir)
    if found is not None:
        _raise_duplicates(id_column, found)


# --- reading ----------------------------------------------------------------------------------------


def _id_arrays(files: list[str], id_column: str, storage_options: dict[str, Any] | None) -> Iterator[Any]:
    """The id column of every file, in input order, one record batch at a time (dictionaries decoded)."""
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.inputs import InputError
    from airflow_provider_batchinfer.stage import Stage

    for location in files:
        stage = Stage.open(location, storage_options)
        with stage.fs.open_input_file(stage.path) as f:
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
        from airflow_provider_batchinfer.inputs import InputError

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
    first_rows = _values(order, "u8")[starts]
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
    from airflow_provider_batchinfer.inputs import InputError

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
            bounds = _bounds(parts, partitions)
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


def _bounds(parts: Any, partitions: int) -> list[int]:
    import numpy as np

    return [0, *np.cumsum(np.bincount(parts, minlength=partitions)).tolist()]


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


# --- hashing ----------------------------------------------------------------------------------------


def partition_of(ids: Any, partitions: int) -> Any:
    """The partition (``0..partitions-1``, a numpy array) of each id of an Arrow array without nulls;
    equal values get equal partitions, in any batch of any file."""
    import numpy as np

    hashed = _hash(ids) % np.uint64(partitions)
    return hashed.astype(np.uint16 if partitions <= 1 << 16 else np.int64)


def _mix(x: Any) -> Any:
    """splitmix64's finaliser on a uint64 numpy array (wrapping arithmetic): every input bit moves
    every output bit, so ``% partitions`` spreads even sequential ids evenly."""
    import numpy as np

    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_M1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def _hash(ids: Any) -> Any:
    import numpy as np
    import pyarrow as pa

    kind = ids.type
    if pa.types.is_boolean(kind):
        ids, kind = ids.cast(pa.int8()), pa.int8()
    if pa.types.is_temporal(kind) and not pa.types.is_interval(kind):
        ids = ids.view(pa.int64() if kind.bit_width == 64 else pa.int32())
        kind = ids.type
    if pa.types.is_integer(kind):
        signed = "i" if pa.types.is_signed_integer(kind) else "u"
        return _mix(_values(ids, f"{signed}{kind.bit_width // 8}").astype(np.int64).view(np.uint64))
    if pa.types.is_floating(kind):
        values = _values(ids, f"f{kind.bit_width // 8}").astype(np.float64) + 0.0  # -0.0 becomes 0.0
        values[np.isnan(values)] = np.nan  # every NaN payload alike
        return _mix(values.view(np.uint64))
    if pa.types.is_decimal(kind):
        width = kind.bit_width // 8
        raw = np.frombuffer(ids.buffers()[1], dtype=np.uint8)[ids.offset * width : (ids.offset + len(ids)) * width]
        matrix = raw.reshape(len(ids), width).astype(np.uint64) + np.uint64(1)
        return _mix((matrix * _weights(width)).sum(axis=1, dtype=np.uint64))
    if pa.types.is_binary(kind) or pa.types.is_string(kind) or pa.types.is_fixed_size_binary(kind):
        ids = ids.cast(pa.large_binary())
    if pa.types.is_large_binary(ids.type) or pa.types.is_large_string(ids.type):
        return _hash_bytes(ids)
    # any other type (nested, view types): Python's hash of the value; equal values hash alike
    return _mix(np.fromiter((_py_hash(v) for v in ids.to_pylist()), dtype=np.int64, count=len(ids)).view(np.uint64))


def _py_hash(value: Any) -> int:
    """Python's hash of a value, or of its ``repr`` where the value (a list, a dict) has none."""
    try:
        return hash(value)
    except TypeError:
        return hash(repr(value))


def _values(ids: Any, dtype: str) -> Any:
    """The values of a fixed-width Arrow array as a numpy array over its buffer (no copy, and no
    ``to_numpy``, which imports pandas)."""
    import numpy as np

    width = np.dtype(dtype).itemsize
    return np.frombuffer(ids.buffers()[1], dtype=dtype, count=len(ids), offset=ids.offset * width)


def _weights(length: int) -> Any:
    """One odd 64-bit weight per byte position: the byte hash is a weighted sum of the bytes."""
    import numpy as np

    return _mix(np.arange(1, length + 1, dtype=np.uint64) * np.uint64(_M3)) | np.uint64(1)


def _hash_bytes(ids: Any) -> Any:
    """A weighted sum of each value's bytes (position-dependent weights) and its length, mixed;
    computed over slices of about ``HASH_SLICE_BYTES`` so the temporaries stay small."""
    import numpy as np

    offsets = np.frombuffer(ids.buffers()[1], dtype=np.int64)[ids.offset : ids.offset + len(ids) + 1]
    data = np.frombuffer(ids.buffers()[2], dtype=np.uint8) if ids.buffers()[2] is not None else np.zeros(0, np.uint8)
    out = np.empty(len(ids), dtype=np.uint64)
    cuts = np.searchsorted(offsets, np.arange(offsets[0], offsets[-1], HASH_SLICE_BYTES), side="right") - 1
    cuts = np.unique(np.concatenate([[0], cuts, [len(ids)]]))
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        start, stop = offsets[lo], offsets[hi]
        lengths = np.diff(offsets[lo : hi + 1])
        position = np.arange(stop - start, dtype=np.int64) - np.repeat(offsets[lo:hi] - start, lengths)
        terms = (data[start:stop].astype(np.uint64) + np.uint64(1)) * _weights(int(lengths.max(initial=0)))[position]
        sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)])
        ends = offsets[lo + 1 : hi + 1] - start
        out[lo:hi] = sums[ends] - sums[ends - lengths]
        out[lo:hi] ^= lengths.astype(np.uint64) * np.uint64(_M3)
    return _mix(out)
