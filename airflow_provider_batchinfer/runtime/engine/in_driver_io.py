"""Reading and writing for a job scored in the driver process (``in_driver.py``).

A reader thread decodes the input ahead of the model and a writer thread encodes parts behind it,
so reading, scoring and writing overlap the way Ray Data's read, map and write operators do, but
in one process: pyarrow and torch release the GIL while they work. The queues between them are
short, so memory stays a few batches deep however large the input is; the reader runs ahead while
the model loads, which hides most of the input's first reads behind torch's import.

Parts are named and checksummed as Ray's write tasks name theirs (``part-<n>-<attempt>``, the
sha256 of the bytes computed while they are written), a new one for each input file and after
``JobSpec.rows_per_part`` rows (RESUME's unit) or ``Tuning.part_bytes`` bytes; rows that failed go to the
dead-letter file with the same number.

The two engines share their score→write core: the replica (``usage.MeteredReplica`` built from
``pool_dataset.replica_kwargs``) and the writer's rows and files (``io.finish_rows``,
``io._PartWriter``) are the same on the pool, where Ray Data's actors and tasks run them, and here,
where threads do. Each reads with its own reader over the same files and columns: Ray Data's
``read_parquet`` on the pool, ``parquet_read.row_group_batches`` here.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import FileEntry, part_name
from airflow_provider_batchinfer.runtime.inputs.parquet_read import row_group_batches
from airflow_provider_batchinfer.runtime.job import CheckedJob
from airflow_provider_batchinfer.runtime.output.parts import _PartWriter, finish_rows
from airflow_provider_batchinfer.runtime.output.table_commit import provenance_of
from airflow_provider_batchinfer.runtime.tuning import TUNING

if TYPE_CHECKING:
    import pyarrow as pa


def driver_batch_rows(checked: CheckedJob, concurrent_calls: bool = False) -> int:
    """Rows per batch for a job scored in the driver: the plan's, at most ``TUNING.driver_batch_rows``
    (``TUNING.concurrent_batch_rows`` for a model called from several threads at once). The batches
    in flight are what the driver holds, so this cap, not the input files' size
    (``plan.batch_rows_for_input``), bounds its memory."""
    cap = TUNING.concurrent_batch_rows if concurrent_calls else TUNING.driver_batch_rows
    return max(1, min(checked.batch_rows, cap))


class Aborted(Exception):
    """The other side of a :class:`Pipe` stopped: the job is failing elsewhere."""


_END = object()


class Pipe:
    """A bounded queue between two threads that either side can abort, waking the other."""

    def __init__(self, size: int | None = None) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(TUNING.queue_batches if size is None else size)
        self.aborted = threading.Event()
        self.error: BaseException | None = None  # the writing side's own failure, for the reader

    def put(self, item: Any) -> None:
        while not self.aborted.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise Aborted()

    def get(self) -> Any:
        while self.error is None:
            try:
                return self._queue.get(timeout=0.2)
            except queue.Empty:
                if self.aborted.is_set():
                    raise Aborted() from None
        raise self.error

    def __iter__(self) -> Any:
        while (item := self.get()) is not _END:
            yield item

    def close(self) -> None:
        self.put(_END)

    def fail(self, error: BaseException) -> None:
        """Hand ``error`` to the reader of this pipe: its next ``get`` raises it, queued items or not."""
        self.error = error
        self.aborted.set()


class Worker(threading.Thread):
    """A daemon thread whose error the job raises: ``result()`` joins it and re-raises."""

    def __init__(self, target: Callable[[], Any], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None
        self.value: Any = None

    def run(self) -> None:
        try:
            self.value = self._target_fn()
        except BaseException as exc:  # raised in the job's thread by result()
            self.error = exc

    def result(self) -> Any:
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def read_batches(checked: CheckedJob, out: Pipe, rows: int) -> None:
    """Every file to read's columns of the plan in batches of at most ``rows`` rows, tagged
    with the file's number, one row group at a time (``parquet_read.py``); a resumed attempt
    reads only the rows left (``resume.py``), as the pool does."""
    try:
        for index, location in enumerate(checked.read_files):
            groups = range(len(checked.read_groups[index]))
            for table in row_group_batches(location, checked.storage, checked.plan["read"], groups, rows):
                if table.num_rows:
                    out.put((index, table))
        out.close()
    except Aborted:
        return
    except BaseException as exc:
        out.fail(exc)


class PartRoller:
    """The run directory's parts for this attempt, opened and closed in order as rows arrive."""

    def __init__(self, checked: CheckedJob) -> None:
        self.checked = checked
        self.rows_per_part = checked.job.job_spec.rows_per_part
        self.provenance = provenance_of(checked.job)  # a table's rows carry the run key and model version
        self.parts: list[FileEntry] = []
        self.error_parts: list[FileEntry] = []
        self._number = -1
        self._file_index: int | None = None
        self._rows = 0
        self._out: _PartWriter | None = None
        self._errors: _PartWriter | None = None

    def write(self, file_index: int, table: pa.Table) -> None:
        """Rows scored from input file ``file_index``, cut at the part boundaries."""
        while table.num_rows:
            full = self.rows_per_part is not None and self._rows >= self.rows_per_part
            too_big = self._out is not None and self._out.sink is not None and self._out.sink.size >= TUNING.part_bytes
            if self._out is None or file_index != self._file_index or full or too_big:
                self._next_part(file_index)
            room = table.num_rows if self.rows_per_part is None else self.rows_per_part - self._rows
            self._write_rows(table.slice(0, room))
            table = table.slice(room)

    def _write_rows(self, table: pa.Table) -> None:
        assert self._out is not None and self._errors is not None
        self._rows += table.num_rows
        good, bad = finish_rows(table, self.checked.plan["passthrough"], self.provenance)
        with self._out.stage._io("write"):
            if good is not None:
                self._out.write(good)
            if bad is not None:
                self._errors.write(bad)

    def _next_part(self, file_index: int) -> None:
        self.close()
        self._number += 1
        self._file_index, self._rows = file_index, 0
        attempt, run_dir = self.checked.job.attempt, self.checked.run_dir
        name, error_name = part_name(self._number, attempt), part_name(self._number, attempt, dead_letter=True)
        self._out = _PartWriter(run_dir.child(name), name)
        self._errors = _PartWriter(run_dir.child(*error_name.split("/")), error_name)

    def close(self) -> None:
        """Finish the open part (and its dead-letter file); keep their entries."""
        if self._out is None or self._errors is None:
            return
        with self._out.stage._io("write"):
            part, error_part = self._out.close(), self._errors.close()
        self._out = self._errors = None
        self.parts += [part] if part else []
        self.error_parts += [error_part] if error_part else []


def write_parts(checked: CheckedJob, scored: Pipe) -> tuple[list[FileEntry], list[FileEntry]]:
    """The writer thread: every scored table into parts; (parts, dead-letter files) when the model is done."""
    roller = PartRoller(checked)
    try:
        for file_index, table in scored:
            roller.write(file_index, table)
    finally:
        roller.close()
    return roller.parts, roller.error_parts
