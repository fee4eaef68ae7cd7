"""Incremental scoring's lookup in a fixed amount of memory: where an earlier run scored each input row.

The earlier run's keys (``_reuse/<part>.keys.parquet``, row ``i`` = row ``i`` of the part) and the
input's keys are matched in the driver before Ray starts, as RESUME's done set matches ids
(``done_set.py``): both are split by a stable hash of the key into partitions of about
``Tuning.reuse_rows_per_partition`` rows, spilled to Arrow IPC stream files in a temporary
directory, and each partition is matched alone (a hash join, ``pyarrow.compute.index_in``). Equal
keys always share a partition, so matching partition by partition matches the whole input; every
step is one pass over the rows of both runs, so the time is linear in them.

1. :meth:`ReuseMatch.match` reads each key file (its sha256 and rows checked first, streamed) and
   each input file's model-input columns (keyed here by ``reuse_keys.row_keys``, one record batch at
   a time), spills both, and matches partition by partition. Each input row's key and earlier place
   (part, row; or none) is spilled again by its row number in the input, in chunks of the same size,
   so no step holds more than one partition or one chunk.
2. :meth:`ReuseMatch.write_keyed` copies each input file with every row's key and earlier place as
   columns (filled chunk by chunk, in row order). The actor pool reads these copies instead of the
   input (``pool_dataset.py``), so every block carries where its rows' predictions are and no actor
   holds the earlier run's keys.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.runtime import tuning
from airflow_provider_batchinfer.runtime.incremental.keys import (
    KEY_BYTES,
    KEY_COLUMN,
    SOURCE_PART_COLUMN,
    SOURCE_ROW_COLUMN,
    ReuseIndexError,
    key_array,
    row_keys,
)
from airflow_provider_batchinfer.runtime.incremental.source import ReusePlan
from airflow_provider_batchinfer.runtime.rows.done_set import Spill, read_spill
from airflow_provider_batchinfer.runtime.rows.unique_ids import READ_BATCH_ROWS
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa


#: an earlier row's place: its part's number in the bits above these, its row in the part in these
_ROW_BITS = 40
#: bytes of a key file hashed at once while its sha256 is checked
HASH_READ_BYTES = 1 << 20


class ReuseMatch:
    """The match of one input against one earlier run's keys, spilled to a temporary directory;
    memory stays at about ``Tuning.reuse_rows_per_partition`` rows (``rows_per_partition``). Close it
    (or use it as a context manager) to remove the spill files."""

    def __init__(
        self,
        context: str,
        columns: Sequence[str],
        storage: Mapping[str, Any] | None,
        rows_per_partition: int | None = None,
        spill_dir: str | None = None,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="batchinfer-reuse-", dir=spill_dir)
        self.context, self.columns = context, list(columns)
        self.storage = dict(storage) if storage else None
        self.budget = max(1, rows_per_partition or tuning.TUNING.reuse_rows_per_partition)
        self.partitions = 0
        self.input_rows = 0
        self.found = 0  # input rows with an earlier place
        self.largest = 0  # the most rows (both runs') of one partition, held while it is matched

    def __enter__(self) -> ReuseMatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._tmp.cleanup()

    def _path(self, name: str) -> str:
        return os.path.join(self._tmp.name, name)

    def match(self, key_files: Sequence[tuple[int, str, int, str]], files: Sequence[str], input_rows: int) -> int:
        """Match ``files`` (``input_rows`` rows, which sizes the partitions) against the key files
        ``(part index, location, rows, sha256)``; the input rows found. Raises ReuseIndexError when
        a key file does not match its sha256 or rows."""
        import pyarrow as pa

        earlier_rows = sum(f[2] for f in key_files)
        self.partitions = max(1, math.ceil(max(earlier_rows, input_rows) / self.budget))
        earlier = Spill(self._path("earlier"), self.partitions, self.budget)
        try:
            for part, location, rows, sha256 in key_files:
                for places, keys in _key_file(location, part, rows, sha256, self.storage):
                    earlier.add(pa.record_batch([places], names=["place"]), keys)
        finally:
            earlier.close()
        given = Spill(self._path("input"), self.partitions, self.budget)
        try:
            for places, keys in self._input_keys(files):
                given.add(pa.record_batch([places], names=["place"]), keys)
        finally:
            given.close()
        chunks = _Chunks(self._path("rows"), self.budget)
        try:
            for old_path, new_path in zip(earlier.paths, given.paths, strict=True):
                self._match_partition(old_path, new_path, chunks)
        finally:
            chunks.close()
        self.found = chunks.found
        return self.found

    def _match_partition(self, old_path: str, new_path: str, chunks: _Chunks) -> None:
        import numpy as np
        import pyarrow.compute as pc

        old, new = read_spill(old_path), read_spill(new_path)
        for used in (old_path, new_path):  # matched: its disk space goes back at once
            if os.path.exists(used):
                os.remove(used)
        if new is None:
            return
        self.largest = max(self.largest, new.num_rows + (old.num_rows if old is not None else 0))
        keys = new.column("id").combine_chunks()
        sources = np.full(len(keys), -1, np.int64)
        if old is not None:
            at = pc.index_in(keys, value_set=old.column("id").combine_chunks())
            hit = np.asarray(pc.is_valid(at))
            places = np.asarray(old.column("place").combine_chunks(), dtype=np.int64)
            sources[hit] = places[np.asarray(at.filter(pc.is_valid(at)), dtype=np.int64)]
        chunks.add(np.asarray(new.column("place").combine_chunks(), dtype=np.int64), keys, sources)

    def _input_keys(self, files: Sequence[str]) -> Iterator[tuple[pa.Array, pa.Array]]:
        """``(row numbers in the whole input, keys)`` of every input row, one record batch at a time."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        offset = 0
        for location in files:
            stage = Stage.open(location, self.storage)
            with stage.fs.open_input_file(stage.path) as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=READ_BATCH_ROWS, columns=self.columns):
                    n = batch.num_rows
                    keys = key_array(row_keys(pa.Table.from_batches([batch]), self.columns, self.context))
                    yield pa.array(np.arange(offset, offset + n, dtype=np.int64)), keys
                    offset += n
        self.input_rows = offset

    def write_keyed(self, files: Sequence[str], columns: Sequence[str], dest: Stage) -> list[str]:
        """Copy the ``columns`` of each of ``files`` (after :meth:`match`) into ``dest`` with each row's
        key and earlier place (part index or -1, row); the copies' locations, in input order."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        dest.fs.create_dir(dest.path, recursive=True)
        rows = _Aligned(self._path("rows"), self.budget, self.input_rows)
        out = []
        for index, location in enumerate(files):
            source, copy = Stage.open(location, self.storage), dest.child(f"keyed-{index:05d}.parquet")
            with source.fs.open_input_file(source.path) as f, copy.fs.open_output_stream(copy.path) as sink:
                pf = pq.ParquetFile(f)
                wanted = set(columns)
                schema = pa.schema([field for field in pf.schema_arrow if field.name in wanted])
                schema = schema.append(pa.field(KEY_COLUMN, pa.binary(KEY_BYTES)))
                schema = schema.append(pa.field(SOURCE_PART_COLUMN, pa.int32()))
                schema = schema.append(pa.field(SOURCE_ROW_COLUMN, pa.int64()))
                with pq.ParquetWriter(sink, schema) as writer:
                    for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=schema.names[:-3]):
                        keys, part, row = rows.take(batch.num_rows)
                        writer.write_batch(
                            pa.record_batch([*batch.columns, keys, pa.array(part), pa.array(row)], schema=schema)
                        )
            out.append(copy.location)
        rows.finish()
        return out


def _key_file(
    location: str, part: int, rows: int, sha256: str, storage: Mapping[str, Any] | None
) -> Iterator[tuple[pa.Array, pa.Array]]:
    """``(places, keys)`` of one earlier key file, one record batch at a time, after its sha256 (read
    in pieces) and its rows are checked against the earlier run's ``_SUCCESS``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    stage = Stage.open(location, dict(storage) if storage else None)
    digest = hashlib.sha256()
    with stage.fs.open_input_stream(stage.path) as f:
        while piece := f.read(HASH_READ_BYTES):
            digest.update(piece)
    if digest.hexdigest() != sha256:
        raise ReuseIndexError(f"{location} does not match its sha256 in the earlier run's _SUCCESS")
    with stage.fs.open_input_file(stage.path) as f:
        pf = pq.ParquetFile(f)
        if pf.metadata.num_rows != rows:
            raise ReuseIndexError(
                f"{location} holds {pf.metadata.num_rows} keys but the earlier run's _SUCCESS says {rows}"
            )
        offset = part << _ROW_BITS
        for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=["key"]):
            n = batch.num_rows
            yield pa.array(np.arange(offset, offset + n, dtype=np.int64)), batch.column(0)
            offset += n


class _Chunks:
    """Each input row's key and earlier place, spilled by the row's number in the input into one IPC
    stream file per ``rows`` rows (one writer per chunk: as many as the partitions, whatever the
    number of input files)."""

    def __init__(self, prefix: str, rows: int) -> None:
        self.prefix, self.rows = prefix, rows
        self.found = 0
        self._writers: dict[int, Any] = {}

    def add(self, numbers: np.ndarray, keys: pa.Array, sources: np.ndarray) -> None:
        import numpy as np
        import pyarrow as pa

        self.found += int((sources >= 0).sum())
        chunk = numbers // self.rows
        order = np.argsort(chunk, kind="stable")
        chunk, numbers, sources, keys = chunk[order], numbers[order], sources[order], keys.take(pa.array(order))
        cuts = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), len(chunk)]
        for lo, hi in itertools.pairwise(cuts):
            c = int(chunk[lo])
            batch = pa.record_batch(
                [pa.array(numbers[lo:hi]), keys.slice(lo, hi - lo), pa.array(sources[lo:hi])],
                names=["row", "key", "source"],
            )
            if c not in self._writers:
                self._writers[c] = pa.ipc.new_stream(pa.OSFile(f"{self.prefix}-{c}.arrows", "wb"), batch.schema)
            self._writers[c].write_batch(batch)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


class _Aligned:
    """The chunks of :class:`_Chunks` read back in input row order: ``take(n)`` gives the next ``n``
    rows' keys and earlier places; one chunk, made dense, is held at a time."""

    def __init__(self, prefix: str, rows: int, total: int) -> None:
        self.prefix, self.rows, self.total = prefix, rows, total
        self.chunk = -1
        self.at = 0  # the next row's number in the input
        self.keys: Any = None
        self.sources: Any = None

    def _load(self, chunk: int) -> None:
        import numpy as np

        first = chunk * self.rows
        size = min(self.rows, self.total - first)
        path = f"{self.prefix}-{chunk}.arrows"
        table = read_spill(path)
        held = 0 if table is None else table.num_rows
        if held != size:
            raise RuntimeError(f"reuse match: chunk {chunk} holds {held} rows, not {size}")
        at = np.asarray(table.column("row").combine_chunks(), dtype=np.int64) - first
        keys = table.column("key").combine_chunks()
        raw = np.frombuffer(keys.buffers()[1], np.uint8)[keys.offset * KEY_BYTES : (keys.offset + size) * KEY_BYTES]
        self.keys = np.zeros((size, KEY_BYTES), np.uint8)
        self.keys[at] = raw.reshape(size, KEY_BYTES)
        self.sources = np.full(size, -1, np.int64)
        self.sources[at] = np.asarray(table.column("source").combine_chunks(), dtype=np.int64)
        self.chunk = chunk
        os.remove(path)

    def take(self, n: int) -> tuple[pa.Array, np.ndarray, np.ndarray]:
        """(keys, part index or -1, row) of the next ``n`` rows."""
        import numpy as np

        keys, sources = [], []
        end = self.at + n
        while self.at < end:
            chunk = self.at // self.rows
            if chunk != self.chunk:
                self._load(chunk)
            lo = self.at - chunk * self.rows
            hi = min(self.rows, end - chunk * self.rows)
            keys.append(self.keys[lo:hi])
            sources.append(self.sources[lo:hi])
            self.at += hi - lo
        key_bytes = np.concatenate(keys).tobytes() if keys else b""
        source = np.concatenate(sources) if sources else np.zeros(0, np.int64)
        found = source >= 0
        part = np.where(found, source >> _ROW_BITS, -1).astype(np.int32)
        row = np.where(found, source & ((1 << _ROW_BITS) - 1), 0).astype(np.int64)
        return key_array(key_bytes), part, row

    def finish(self) -> None:
        if self.at != self.total:
            raise RuntimeError(f"reuse match: {self.at} rows copied, but the input has {self.total}")


def prepare(
    plan: ReusePlan | None,
    dest: Stage,
    storage: dict[str, Any] | None,
    read_files: list[str],
    read_columns: list[str],
    todo_rows: int,
) -> None:
    """Before Ray: match the rows this attempt reads (``read_files``, ``todo_rows`` of them) against
    the earlier run's keys and write the keyed copies the pool reads into ``dest`` (``ReusePlan.state``:
    ``files``, ``loaded``, ``reuse_s``). A key file that fails its checks leaves every row to be
    scored (a note), never half-reuse."""
    if plan is None or plan.source is None:
        return
    started = time.monotonic()
    source = plan.source
    with ReuseMatch(plan.context, plan.columns, storage) as matcher:
        try:
            found = matcher.match(source.key_files, read_files, todo_rows)
        except ReuseIndexError as exc:
            plan.notes.append(f"not reusing {source.run_dir}: {exc}; every row is scored")
            plan.state["reuse_s"] = round(time.monotonic() - started, 3)
            return
        plan.state["files"] = matcher.write_keyed(read_files, read_columns, dest)
        plan.state["loaded"] = True
        seconds = plan.state["reuse_s"] = round(time.monotonic() - started, 3)
        print(
            f"[batchinfer] reuse: matched {matcher.input_rows:,} input row(s) against {source.indexed_rows:,} keys "
            f"of {source.run_dir} in {matcher.partitions} partition(s) of about {matcher.budget:,} rows (at most "
            f"{matcher.largest:,} held at once): {found:,} found ({seconds:.3f} s)",
            flush=True,
        )
