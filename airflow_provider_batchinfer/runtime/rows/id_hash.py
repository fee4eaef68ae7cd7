"""A stable 64-bit hash of id values, the hash partition of each id, and whether any two ids of an
input share a hash.

The uniqueness check and RESUME's done set split ids into partitions that are checked one at a
time; equal values must always land in the same partition, in any batch of any file, and distinct
ones must spread evenly. The uniqueness check first looks only at the hashes (``hashes_repeat``):
fixed-width, and cheaper to compare than the ids themselves. The hash is vectorised numpy over the values' bits
(integers, temporals, floats with ``-0.0``/NaN made equal), their bytes (strings, binary, decimals),
or Python's ``hash`` of the value for any other type (slower, but still consistent within a process).
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: bytes of string/binary ids hashed at once: the hash's temporaries are 8 bytes per byte of input
HASH_SLICE_BYTES = 1 << 20

_M1, _M2, _M3 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


def partition_of(ids: Any, partitions: int) -> Any:
    """The partition (``0..partitions-1``, a numpy array) of each id of an Arrow array without nulls;
    equal values get equal partitions, in any batch of any file."""
    import numpy as np

    hashed = hash_ids(ids) % np.uint64(partitions)
    return hashed.astype(np.uint16 if partitions <= 1 << 16 else np.int64)


def _scaled(hashes: Any, bits: str, n: int, scratch: Any) -> Any:
    """Each hash's low or high 32 bits scaled to ``0..n-1`` (``(x * n) >> 32``: a multiply and a
    shift, where ``%`` divides), computed in ``scratch``; ``uint16`` when ``n`` fits it."""
    import numpy as np

    if bits == "low":
        np.bitwise_and(hashes, np.uint64(0xFFFFFFFF), out=scratch)
    else:
        np.right_shift(hashes, np.uint64(32), out=scratch)
    np.multiply(scratch, np.uint64(n), out=scratch)
    np.right_shift(scratch, np.uint64(32), out=scratch)
    return scratch.astype(np.uint16 if n <= 1 << 16 else np.int64)


# --- whether any two ids share a hash ----------------------------------------------------------------

#: hashes looked up at once for a repeat: a hash table of this many stays in a core's cache, where
#: sorting or hashing a whole partition runs from main memory at several times the cost per id
CHECK_BUCKET = 1 << 14
#: threads hashing files and checking partitions: each splits the budget further, so more threads
#: mean smaller partitions, more spill files and smaller appends to each; two already keep the
#: check well under a job's scoring time
MAX_THREADS = 4


def hashes_repeat(
    file_count: int,
    read_file: Callable[[int], Iterator[Any]],
    partitions: int,
    budget: int,
    spill_dir: str | None,
) -> tuple[int, bool]:
    """(null ids, whether two ids share a hash) over ``file_count`` files, whose ids (Arrow arrays)
    ``read_file(i)`` yields batch by batch; with nulls the repeat is not looked for (``False``).

    Equal ids have equal hashes, so no repeated hash proves the ids unique. With more than one
    partition (``partitions`` of about ``budget`` ids), the hashes are spilled under ``spill_dir``
    by their low 32 bits and each partition is checked alone. Files are hashed, and partitions
    checked, on as many threads as there are cores (reading Parquet, numpy's arithmetic and
    pandas' hash tables run outside the GIL), each into partitions ``threads`` times smaller, so
    the threads together hold about ``budget`` hashes. A failing read fails with the first such
    file in input order."""
    import numpy as np

    if partitions == 1:
        spill = _HashSpill(1, budget, None, 0)
        for i in range(file_count):
            for ids in read_file(i):
                spill.add(ids)
        held = np.concatenate(spill.waiting) if spill.waiting else np.zeros(0, np.uint64)
        return spill.nulls, not spill.nulls and _repeats(held)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, min(file_count, cores, MAX_THREADS))  # the cores this process may run on
    partitions *= threads  # each thread holds one partition at a time: ``budget`` hashes in all
    with tempfile.TemporaryDirectory(prefix="batchinfer-ids-", dir=spill_dir) as tmp:
        nulls = _spill_hashes(file_count, read_file, partitions, budget, tmp, threads)
        if nulls:
            return nulls, False
        with ThreadPoolExecutor(threads, thread_name_prefix="batchinfer-ids") as pool:
            return 0, any(pool.map(lambda p: _repeats(_read_hashes(tmp, p, threads)), range(partitions)))


def _read_hashes(tmp: str, partition: int, threads: int) -> Any:
    """Every hash spilled to ``partition``, by any of the ``threads``, read into one array."""
    import numpy as np

    named = (os.path.join(tmp, f"{partition}-{thread}.u64") for thread in range(threads))
    paths = [path for path in named if os.path.exists(path)]
    hashes = np.empty(sum(os.path.getsize(p) for p in paths) // 8, dtype=np.uint64)
    filled = 0
    for path in paths:
        with open(path, "rb") as f:
            filled += f.readinto(hashes[filled:].data) // 8
    return hashes[:filled]


def _repeats(hashes: Any) -> bool:
    """Whether a numpy array of hashes holds a value twice: the hashes are grouped into buckets of
    about ``CHECK_BUCKET`` by their high 32 bits (equal hashes share a bucket), then each bucket's
    distinct values are counted in a hash table."""
    import numpy as np
    import pandas as pd

    buckets = max(1, min(len(hashes) // CHECK_BUCKET, 1 << 16))
    scratch = np.empty_like(hashes)
    which = _scaled(hashes, "high", buckets, scratch)
    grouped = np.take(hashes, which.argsort(kind="stable"), out=scratch) if buckets > 1 else hashes  # radix sort
    bounds = partition_bounds(which, buckets)
    return any(len(pd.unique(grouped[lo:hi])) < hi - lo for lo, hi in itertools.pairwise(bounds))


def _spill_hashes(
    file_count: int,
    read_file: Callable[[int], Iterator[Any]],
    partitions: int,
    budget: int,
    tmp: str,
    threads: int,
) -> int:
    """Hash every file's ids into partition files of raw ``uint64`` (``<partition>-<thread>.u64``),
    ``threads`` files at once; the null ids seen."""
    order = iter(range(file_count))
    lock = threading.Lock()
    errors: dict[int, BaseException] = {}

    def work(thread: int) -> int:
        spill = _HashSpill(partitions, max(1, budget // threads), tmp, thread)
        while True:
            with lock:
                index = next(order, None)
            if index is None:
                return spill.finish()
            try:
                for ids in read_file(index):
                    spill.add(ids)
            except Exception as exc:  # re-raised below, in input order
                errors[index] = exc

    with ThreadPoolExecutor(threads, thread_name_prefix="batchinfer-ids") as pool:
        nulls = sum(pool.map(work, range(threads)))
    if errors:
        raise errors[min(errors)]
    return nulls


class _HashSpill:
    """One thread's hashes: they wait in memory until ``budget`` of them are held, then each
    partition's are appended to its file at once (with no ``tmp``, they stay in ``waiting``).
    Nothing more is kept once a null id is seen (the check fails on it); nulls are still counted,
    for the message."""

    def __init__(self, partitions: int, budget: int, tmp: str | None, thread: int) -> None:
        self.partitions, self.budget, self.tmp, self.thread = partitions, budget, tmp, thread
        self.waiting: list[Any] = []
        self.held = self.nulls = 0
        self.buffers: tuple[Any, Any] | None = None

    def add(self, ids: Any) -> None:
        self.nulls += ids.null_count
        if self.nulls or not len(ids):
            return
        self.waiting.append(hash_ids(ids))
        self.held += len(ids)
        if self.held >= self.budget and self.tmp is not None:
            self._flush(self.tmp)

    def finish(self) -> int:
        if not self.nulls and self.tmp is not None:
            self._flush(self.tmp)
        return self.nulls

    def _flush(self, tmp: str) -> None:
        import numpy as np

        if not self.waiting:
            return
        held = sum(len(h) for h in self.waiting)
        if self.buffers is None or len(self.buffers[0]) < held:  # kept between flushes: no new pages
            self.buffers = (np.empty(held, np.uint64), np.empty(held, np.uint64))
        hashes, grouped = (b[:held] for b in self.buffers)
        np.concatenate(self.waiting, out=hashes)
        self.waiting, self.held = [], 0
        parts = _scaled(hashes, "low", self.partitions, grouped)
        np.take(hashes, parts.argsort(kind="stable"), out=grouped)  # a radix sort of small integers
        bounds = partition_bounds(parts, self.partitions)
        view = grouped.data  # slices of it are written without a copy
        for p in range(self.partitions):
            if bounds[p + 1] > bounds[p]:
                with open(os.path.join(tmp, f"{p}-{self.thread}.u64"), "ab") as f:
                    f.write(view[bounds[p] : bounds[p + 1]])


def partition_bounds(parts: Any, partitions: int) -> list[int]:
    """Where each partition's run starts and ends once ``parts`` is sorted."""
    import numpy as np

    return [0, *np.cumsum(np.bincount(parts, minlength=partitions)).tolist()]


# --- the hash ------------------------------------------------------------------------------------------


def _mix(x: Any) -> Any:
    """splitmix64's finaliser on a uint64 numpy array (wrapping arithmetic): every input bit moves
    every output bit, so ``% partitions`` spreads even sequential ids evenly."""
    import numpy as np

    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_M1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def hash_ids(ids: Any) -> Any:
    """The 64-bit hash (a numpy ``uint64`` array) of each value of an Arrow array without nulls."""
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
        return _mix(array_values(ids, f"{signed}{kind.bit_width // 8}").astype(np.int64).view(np.uint64))
    if pa.types.is_floating(kind):
        values = array_values(ids, f"f{kind.bit_width // 8}").astype(np.float64) + 0.0  # -0.0 becomes 0.0
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


def array_values(ids: Any, dtype: str) -> Any:
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
