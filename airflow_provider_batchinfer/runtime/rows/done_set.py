"""RESUME's done set in a fixed amount of memory: hash-partitioned spill files, one partition at a time.

A resumed attempt must score exactly the input rows whose id no kept part holds. Holding those ids
in the driver (and shipping them to every read task) grows with the rows already scored. Instead,
as the uniqueness check does (``unique_ids.py``), the ids are split by a stable hash of their value
into partitions of about ``Tuning.resume_rows_per_partition`` rows, spilled to Arrow IPC stream
files in a temporary directory, and each partition is matched alone: equal ids always share a
partition, so matching partition by partition matches the whole input. Every step is one pass over
the rows (a hash lookup per row, no sort of the whole set), so the time is linear in the rows.

1. :meth:`DoneSet.add` stores each kept part's ids (with the part's number) in one spill file.
2. :meth:`DoneSet.match` splits the kept ids and the input's ids (each with its file and row
   number, streamed one record batch at a time) into the same partitions, looks each partition's
   input ids up in that partition's kept ids, and spills the done rows' numbers per input file.
3. :meth:`DoneSet.done_rows` yields a partly done input file's done rows, sorted: what it holds
   is a mask of one byte per row of one input file at a time, never the whole set; ``resume.py`` copies the file's other
   rows into the files this attempt reads.

When every stored id matched a distinct input row (input ids are checked unique first), no two kept
parts share an id; otherwise :meth:`DoneSet.shared` names the parts that do, partition by partition.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

from airflow_provider_batchinfer.runtime import tuning
from airflow_provider_batchinfer.runtime.rows.id_hash import partition_of
from airflow_provider_batchinfer.runtime.rows.unique_ids import READ_BATCH_ROWS

#: rows per batch of done row numbers handed back
BATCH_ROWS = READ_BATCH_ROWS
#: a done row's place: its file number in the bits above these, its row number in these
_ROW_BITS = 40


class DoneSet:
    """The ids of the kept parts, spilled to a temporary directory; memory stays at about
    ``Tuning.resume_rows_per_partition`` ids (``rows_per_partition``). Close it (or use it as a
    context manager) to remove the spill files."""

    def __init__(self, spill_dir: str | None = None, rows_per_partition: int | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="batchinfer-done-", dir=spill_dir)
        self.budget = max(1, rows_per_partition or tuning.TUNING.resume_rows_per_partition)
        self._part_rows: dict[int, int] = {}  # ids stored per part number
        self._dropped: set[int] = set()
        self._staged: list[str] = []  # spill files of the ids as added
        self._writer: Any = None  # the open one
        self._schema: Any = None
        self._hits: dict[int, int] = {}  # input file -> done rows, after match()

    @property
    def rows(self) -> int:
        """Ids stored, less those of dropped parts."""
        return sum(n for part, n in self._part_rows.items() if part not in self._dropped)

    def __enter__(self) -> DoneSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        import pyarrow as pa

        self._finish()
        self._tmp.cleanup()
        pa.default_memory_pool().release_unused()  # Arrow keeps freed pages for reuse; the pipeline comes next

    def _finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _path(self, name: str) -> str:
        return os.path.join(self._tmp.name, name)

    def add(self, part: int, ids: Any) -> None:
        """Store the ids (an Arrow array or chunked array) of kept part number ``part``."""
        import numpy as np
        import pyarrow as pa

        if not len(ids):
            return
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
        if pa.types.is_dictionary(ids.type):
            ids = ids.dictionary_decode()
        if self._schema is None:
            self._schema = pa.schema([("part", pa.int32()), ("id", ids.type)])
        if self._writer is None:
            self._staged.append(self._path(f"staged-{len(self._staged)}.arrows"))
            self._writer = pa.ipc.new_stream(pa.OSFile(self._staged[-1], "wb"), self._schema)
        parts = pa.array(np.full(len(ids), part, np.int32))
        self._writer.write_batch(pa.record_batch([parts, ids.cast(self._schema.field("id").type)], self._schema))
        self._part_rows[part] = self._part_rows.get(part, 0) + len(ids)

    def drop(self, parts: Iterable[int]) -> None:
        """Forget the ids of these parts (deleted parts: their rows are scored again)."""
        self._dropped |= set(parts)

    def _staged_batches(self) -> Iterator[Any]:
        """The stored ``(part, id)`` batches, less those of dropped parts."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self._finish()
        dropped = pa.array(sorted(self._dropped), pa.int32())
        for path in self._staged:
            with pa.OSFile(path, "rb") as f:
                for batch in pa.ipc.open_stream(f):
                    if len(dropped):
                        batch = batch.filter(pc.invert(pc.is_in(batch.column(0), value_set=dropped)))
                    if batch.num_rows:
                        yield batch

    def _partitions(self, partitions: int) -> list[str]:
        """Spill the stored ids into ``partitions`` files by hash; their paths."""
        spill = Spill(self._path("done"), partitions, self.budget)
        try:
            for batch in self._staged_batches():
                spill.add(batch.select(["part"]), batch.column(1))
        finally:
            spill.close()
        return spill.paths

    def shared(self) -> list[tuple[int, int]]:
        """Each pair ``(later, earlier)`` of part numbers whose parts hold the same id."""
        import numpy as np
        import pyarrow.compute as pc

        if not self.rows:
            return []
        pairs: set[tuple[int, int]] = set()
        for path in self._partitions(math.ceil(self.rows / self.budget)):
            table = read_spill(path)
            if table is None:
                continue
            ranked = table.take(pc.sort_indices(table, [("id", "ascending"), ("part", "ascending")]))
            same = np.asarray(pc.equal(ranked["id"].slice(1), ranked["id"].slice(0, len(ranked) - 1)))
            if not same.any():
                continue
            parts = np.asarray(ranked["part"])
            start = 0  # each run of equal ids: every later part pairs with every earlier one
            for i in range(1, len(parts) + 1):
                if i == len(parts) or not same[i - 1]:
                    run = sorted(set(parts[start:i].tolist()))
                    pairs.update((b, a) for k, b in enumerate(run) for a in run[:k])
                    start = i
        return sorted(pairs)

    def match(
        self, files: list[str], id_column: str, storage_options: dict[str, Any] | None, input_rows: int
    ) -> dict[int, int]:
        """The done rows of each input file (``{file index: rows}``, files without any left out):
        kept and input ids split into the same partitions, each partition's looked up alone."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self._hits = {}
        if not self.rows:
            return {}
        partitions = math.ceil(max(self.rows, input_rows) / self.budget)
        done_paths = self._partitions(partitions)
        spill = Spill(self._path("input"), partitions, self.budget)
        try:
            for place, ids in _input_ids(files, id_column, storage_options, self._schema.field("id").type):
                spill.add(pa.record_batch([place], names=["place"]), ids)
        finally:
            spill.close()
        hits = _Hits(self._path("hits"))
        try:
            for done_path, input_path in zip(done_paths, spill.paths, strict=True):
                done, rows = read_spill(done_path), read_spill(input_path, ["place"], with_ids=True)
                for used in (done_path, input_path):  # matched: its disk space goes back at once
                    if os.path.exists(used):
                        os.remove(used)
                if done is None or rows is None:
                    continue
                places, ids = rows
                found = pc.is_in(ids, value_set=done.column("id").combine_chunks())
                hits.add(places.filter(found))
        finally:
            hits.close()
        self._hits = hits.counts
        return dict(hits.counts)

    def done_rows(self, files: Iterable[int]) -> Iterator[tuple[int, Any]]:
        """``(file index, row numbers)`` of the done rows of ``files`` (after :meth:`match`), in file
        and row order, a numpy array of at most ``BATCH_ROWS`` rows at a time. A file's done rows
        are marked in a mask of one byte per row of that file, read from its hits batch by batch,
        where holding their row numbers took eight bytes each, and sorting them as many again."""
        import numpy as np

        for file in sorted({int(f) for f in files}):
            if not self._hits.get(file):
                continue
            done = _done_mask(self._path(f"hits-{file}.arrows"))
            for lo in range(0, len(done), BATCH_ROWS):
                rows = np.flatnonzero(done[lo : lo + BATCH_ROWS]) + lo
                if len(rows):
                    yield file, rows


class Spill:
    """Rows split by the hash of their id into ``partitions`` IPC stream files; at most ``budget``
    rows wait in memory before every partition's waiting rows are written. Shared with incremental
    scoring's key match (``reuse_match.py``)."""

    def __init__(self, prefix: str, partitions: int, budget: int) -> None:
        self.paths = [f"{prefix}-{p}.arrows" for p in range(partitions)]
        self.partitions, self.budget = partitions, budget
        self._writers: dict[int, Any] = {}
        self._waiting: dict[int, list[Any]] = {}
        self._held = 0

    def add(self, columns: Any, ids: Any) -> None:
        """``columns`` (a record batch) and ``ids`` of the same rows, into their partitions."""
        import numpy as np
        import pyarrow as pa

        batch = pa.record_batch([*columns.columns, ids], names=[*columns.schema.names, "id"])
        if self.partitions == 1:
            self._waiting.setdefault(0, []).append(batch)
        else:
            parts = partition_of(ids, self.partitions)
            order = parts.argsort(kind="stable")
            grouped = batch.take(pa.array(order))
            bounds = [0, *np.cumsum(np.bincount(parts, minlength=self.partitions)).tolist()]
            for p in range(self.partitions):
                if bounds[p + 1] > bounds[p]:
                    self._waiting.setdefault(p, []).append(grouped.slice(bounds[p], bounds[p + 1] - bounds[p]))
        self._held += batch.num_rows
        if self._held >= self.budget:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        for p, batches in self._waiting.items():
            if p not in self._writers:
                self._writers[p] = pa.ipc.new_stream(pa.OSFile(self.paths[p], "wb"), batches[0].schema)
            self._writers[p].write_table(pa.Table.from_batches(batches).combine_chunks())
        self._waiting.clear()
        self._held = 0

    def close(self) -> None:
        try:
            self._flush()
        finally:
            for writer in self._writers.values():
                writer.close()


class _Hits:
    """The done rows' numbers, one IPC stream file per input file, and how many each holds."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.counts: dict[int, int] = {}
        self._writers: dict[int, Any] = {}

    def add(self, places: Any) -> None:
        import numpy as np
        import pyarrow as pa

        values = np.asarray(places, dtype=np.int64)
        if not len(values):
            return
        files, rows = values >> _ROW_BITS, values & ((1 << _ROW_BITS) - 1)
        order = np.argsort(files, kind="stable")
        files, rows = files[order], rows[order]
        cuts = np.flatnonzero(np.diff(files)) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(files)], strict=True):
            file = int(files[lo])
            if file not in self._writers:
                schema = pa.schema([("row", pa.int64())])
                self._writers[file] = pa.ipc.new_stream(pa.OSFile(f"{self.prefix}-{file}.arrows", "wb"), schema)
            self._writers[file].write_batch(pa.record_batch([pa.array(rows[lo:hi])], names=["row"]))
            self.counts[file] = self.counts.get(file, 0) + hi - lo

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def read_spill(path: str, columns: list[str] | None = None, with_ids: bool = False) -> Any:
    """A spill file as a table (None when the partition got no rows); ``with_ids``: ``(columns' first
    array, ids)``."""
    import pyarrow as pa

    if not os.path.exists(path):
        return None
    with pa.OSFile(path, "rb") as f:
        table = pa.ipc.open_stream(f).read_all()
    if not with_ids:
        return table
    return table.column((columns or ["place"])[0]).combine_chunks(), table.column("id").combine_chunks()


def _done_mask(path: str) -> Any:
    """A hits file's row numbers as a boolean mask over the rows up to the last of them."""
    import numpy as np
    import pyarrow as pa

    mask = np.zeros(0, dtype=bool)
    with pa.OSFile(path, "rb") as f:
        for batch in pa.ipc.open_stream(f):
            rows = np.asarray(batch.column(0), dtype=np.int64)
            if len(rows) and rows.max() >= len(mask):
                mask = np.concatenate([mask, np.zeros(int(rows.max()) + 1 - len(mask), dtype=bool)])
            mask[rows] = True
    return mask


def _input_ids(
    files: list[str], id_column: str, storage_options: dict[str, Any] | None, id_type: Any
) -> Iterator[tuple[Any, Any]]:
    """``(places, ids)`` of every input file's rows, one record batch at a time: a place is the
    file's number and the row's, packed in one int64."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.store.stage import Stage

    for index, location in enumerate(files):
        stage = Stage.open(location, storage_options)
        offset = 0
        with stage.fs.open_input_file(stage.path) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=READ_BATCH_ROWS, columns=[id_column]):
                ids = batch.column(0)
                if pa.types.is_dictionary(ids.type):
                    ids = ids.dictionary_decode()
                n = len(ids)
                places = (np.int64(index) << _ROW_BITS) + np.arange(offset, offset + n, dtype=np.int64)
                yield pa.array(places), ids.cast(id_type)
                offset += n
