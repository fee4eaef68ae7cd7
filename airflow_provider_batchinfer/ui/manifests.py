"""A run's manifest and its first dead-lettered rows, read for the run page.

Read only where the run's XCom says the run committed (``output_location``), through the provider's
storage layer with the connection the run used; the dead-letter sample only from the files that
manifest lists, and only its first rows. Nothing is listed or scanned beyond that. A committed
try's manifest does not change, so what was read is kept per try, in this process; a manifest
that is gone or unreadable becomes a message for the page, and is looked at again next time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, Manifest
from airflow_provider_batchinfer.contract.tables import TABLE_SCHEME
from airflow_provider_batchinfer.stage import Stage, check_relative_path
from airflow_provider_batchinfer.ui.views import RunRow, manifest_view

#: dead-lettered rows shown per run, columns shown per row, characters shown per value
ERROR_SAMPLE_ROWS = 5
ERROR_SAMPLE_COLUMNS = 6
ERROR_VALUE_CHARS = 300
CACHE_RUNS = 256
#: the column of a dead-letter file that holds the error message (runtime/commit.py)
ERROR_MESSAGE = "error"


@dataclass(frozen=True)
class RunDetail:
    """What the run page shows beyond the row: the manifest (or why there is none) and a sample of
    the dead-lettered rows (or why there is none)."""

    manifest: dict[str, Any] | None = None
    problem: str | None = None
    errors: list[dict[str, str]] = field(default_factory=list)
    errors_problem: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest,
            "problem": self.problem,
            "errors": self.errors,
            "errors_problem": self.errors_problem,
            "notes": self.notes,
        }


_cache: OrderedDict[tuple[str, str, str, int, int], RunDetail] = OrderedDict()
_lock = threading.Lock()


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def run_detail(row: RunRow, conn_id: str | None) -> RunDetail:
    """The run's manifest and dead-letter sample, from the cache when this try was read before."""
    if not row.output_location:
        return RunDetail(problem="this try recorded no result (it has not committed), so there is no manifest to show")
    key = (row.dag_id, row.run_id, row.task_id, row.map_index, row.try_number)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    detail = _read_detail(row, conn_id)
    if detail.problem is None:
        with _lock:
            _cache[key] = detail
            while len(_cache) > CACHE_RUNS:
                _cache.popitem(last=False)
    return detail


def _options(conn_id: str | None, table: bool) -> dict[str, Any]:
    """The storage (and, for a table, catalog) options of the run's connection."""
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    hook = ModelServiceHook(conn_id) if conn_id else ModelServiceHook()
    return hook.table_read_options() if table else hook.storage_options


def _read_manifest(location: str, options: dict[str, Any]) -> Manifest | None:
    if location.startswith(TABLE_SCHEME):
        from airflow_provider_batchinfer.tables.read import read_table_manifest

        return read_table_manifest(location, options)
    marker = Stage.open(location, options).child(SUCCESS_MARKER)
    try:
        data = marker.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return Manifest.from_json(data, marker.location)


def _read_detail(row: RunRow, conn_id: str | None) -> RunDetail:
    location = str(row.output_location)
    table = location.startswith(TABLE_SCHEME)
    try:
        options = _options(conn_id, table)
        manifest = _read_manifest(location, options)
    except Exception as exc:  # any failure is the page's message, never a stack trace
        return RunDetail(problem=f"the manifest at {location} could not be read: {_one_line(exc)}")
    if manifest is None:
        return RunDetail(problem=f"the manifest at {location} is gone: the run's output was removed or replaced")
    notes = []
    recorded = row.attempt
    if recorded and manifest.job.attempt != recorded:
        notes.append(
            f"{location} was committed again by attempt {manifest.job.attempt} after this try's attempt "
            f"{recorded}; the manifest shown is the newer one"
        )
    errors, errors_problem = _error_sample(manifest, _storage(options) if table else options)
    return RunDetail(manifest=manifest_view(manifest), errors=errors, errors_problem=errors_problem, notes=notes)


def _storage(options: dict[str, Any]) -> dict[str, Any] | None:
    from airflow_provider_batchinfer.tables.read import split_options

    return split_options(options)[1]


def _error_sample(manifest: Manifest, storage: dict[str, Any] | None) -> tuple[list[dict[str, str]], str | None]:
    """The first dead-lettered rows, from the first file the manifest lists under ``_errors/``."""
    if not manifest.error_files:
        return [], None
    import pyarrow.parquet as pq

    entry = manifest.error_files[0]
    try:
        check_relative_path(entry.name, "dead-letter file name")
        part = Stage.open(manifest.run_dir, storage).child(*entry.name.split("/"))
        with part.fs.open_input_file(part.path) as f:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=ERROR_SAMPLE_ROWS), None)
    except Exception as exc:
        return [], f"the dead-lettered rows in {entry.name} could not be read: {_one_line(exc)}"
    if batch is None:
        return [], None
    names = batch.schema.names
    # the message first, then the ids and passthrough columns the file keeps
    shown = ([ERROR_MESSAGE] if ERROR_MESSAGE in names else []) + [n for n in names if n != ERROR_MESSAGE]
    shown = shown[:ERROR_SAMPLE_COLUMNS]
    columns = {name: batch.column(names.index(name)).to_pylist() for name in shown}
    rows = [{n: str(columns[n][i])[:ERROR_VALUE_CHARS] for n in shown} for i in range(batch.num_rows)]
    return rows, None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]
