"""A run's manifest and its first dead-lettered rows, read for the run page.

The run's XCom (``output_location``) and the manifest are written by the DAG's code, so neither
decides what the api-server opens: the location must lie below the run's connection's stage or
registry root, in a scheme that root uses (``airflow_provider_batchinfer/store/roots.py``), and is opened
from that root with the filesystem and credentials the connection configures. There the
``_SUCCESS`` is read and validated (``markers.validate_manifest``: the schema, the counts, the run
directory it names must be this one, every listed file present with its size); the dead-letter
sample comes only from the first ``_errors/`` file that validated manifest lists, and only its
first rows. Nothing is listed or scanned beyond the run directory. An Iceberg run is read by
``store/iceberg/read.py``, which holds the manifest its snapshot names, and the claim and run directories
that manifest names, to the same rule (the catalog's warehouse counting as a root) before it opens
any of them. A refused location is a message on the page, never a read.

A committed try's manifest does not change, so what was read is kept per try, in this process; a
refusal, or a manifest that is gone or unreadable, is a message for the page and is looked at
again next time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import ERRORS_DIR, SUCCESS_MARKER, Manifest, ManifestError
from airflow_provider_batchinfer.contract.tables import TABLE_SCHEME
from airflow_provider_batchinfer.store.locations import join
from airflow_provider_batchinfer.store.roots import Refused, Roots, open_placed
from airflow_provider_batchinfer.store.stage import Stage
from airflow_provider_batchinfer.ui.views import RunRow, manifest_view

if TYPE_CHECKING:
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

#: dead-lettered rows shown per run, columns shown per row, characters shown per value
ERROR_SAMPLE_ROWS = 5
ERROR_SAMPLE_COLUMNS = 6
ERROR_VALUE_CHARS = 300
CACHE_RUNS = 256
#: the column of a dead-letter file that holds the error message (runtime/output/commit.py)
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


def _hook(conn_id: str | None) -> ModelServiceHook:
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    return ModelServiceHook(conn_id) if conn_id else ModelServiceHook()


def page_roots(hook: ModelServiceHook) -> Roots:
    """Where the page reads a run directory: the connection's ``stage_root`` and ``registry_root``."""
    return {"stage_root": hook.config.stage_root, "registry_root": hook.config.registry_root}


def open_inside(location: str, hook: ModelServiceHook, roots: Roots | None = None) -> Stage:
    """``location`` opened from the connection's root it lies below (``roots``, by default the
    page's), with the filesystem the hook builds for that root (``open_stage``): never from the
    location's own scheme or query, never with credentials the connection does not name.
    :class:`Refused` for any other location."""
    return open_placed(location, page_roots(hook) if roots is None else roots, hook.open_stage)


def _inside(run_dir: Stage, hook: ModelServiceHook, roots: Roots, *parts: str) -> Stage:
    """A file below an opened run directory, placed and opened like the directory itself (so a
    local symlink in the run directory cannot lead out of the roots)."""
    return open_inside(join(run_dir.location, *parts), hook, roots)


def _read_manifest(run_dir: Stage, hook: ModelServiceHook) -> Manifest | None:
    """The run directory's ``_SUCCESS``, validated (``markers.validate_manifest``): the schema, the
    counts, the run directory it names (this one), the claim, and every listed file's name and
    size from one listing. None while there is no marker."""
    from airflow_provider_batchinfer.store.commit.markers import validate_manifest

    marker = _inside(run_dir, hook, page_roots(hook), SUCCESS_MARKER)
    try:
        data = marker.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    manifest = Manifest.from_json(data, marker.location)
    validate_manifest(run_dir, manifest, read_footers=False)
    return manifest


def _read_table(location: str, hook: ModelServiceHook) -> tuple[Manifest | None, Stage | None, Roots]:
    """An Iceberg run's manifest (the connection's catalog resolves the table), its run directory
    and the roots they were placed below: ``store/iceberg/read.py`` refuses, before opening it, any
    manifest, claim or run directory outside the connection's roots."""
    from airflow_provider_batchinfer.store.iceberg.read import open_run_dir, read_table_manifest, table_roots

    options = hook.table_read_options()
    manifest = read_table_manifest(location, options)
    if manifest is None:
        return None, None, table_roots(options)
    return manifest, open_run_dir(manifest, options), table_roots(options)


def _read_detail(row: RunRow, conn_id: str | None) -> RunDetail:
    location = str(row.output_location)
    try:
        hook = _hook(conn_id)
        if location.startswith(TABLE_SCHEME):
            manifest, run_dir, roots = _read_table(location, hook)
        else:
            roots = page_roots(hook)
            run_dir = open_inside(location, hook, roots)
            manifest = _read_manifest(run_dir, hook)
    except Refused as exc:
        return RunDetail(problem=f"the page does not read this run's output: {exc}")
    except ManifestError as exc:
        return RunDetail(problem=f"the manifest at {location} is not valid, so the page shows nothing from it: {exc}")
    except Exception as exc:  # any failure is the page's message, never a stack trace
        return RunDetail(problem=f"the manifest at {location} could not be read: {_one_line(exc)}")
    if manifest is None or run_dir is None:
        return RunDetail(problem=f"the manifest at {location} is gone: the run's output was removed or replaced")
    notes = []
    recorded = row.attempt
    if recorded and manifest.job.attempt != recorded:
        notes.append(
            f"{location} was committed again by attempt {manifest.job.attempt} after this try's attempt "
            f"{recorded}; the manifest shown is the newer one"
        )
    errors, errors_problem = _error_sample(manifest, run_dir, hook, roots)
    return RunDetail(manifest=manifest_view(manifest), errors=errors, errors_problem=errors_problem, notes=notes)


def _error_sample(
    manifest: Manifest, run_dir: Stage, hook: ModelServiceHook, roots: Roots
) -> tuple[list[dict[str, str]], str | None]:
    """The first dead-lettered rows, from the first file the validated manifest lists under
    ``_errors/`` in the run directory that was checked."""
    if not manifest.error_files:
        return [], None
    import pyarrow.parquet as pq

    entry = manifest.error_files[0]
    try:
        if not entry.name.startswith(ERRORS_DIR + "/"):
            raise Refused(f"{entry.name} is not under {ERRORS_DIR}/, where a run keeps its dead-lettered rows")
        part = _inside(run_dir, hook, roots, *entry.name.split("/"))
        with part.fs.open_input_file(part.path) as f:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=ERROR_SAMPLE_ROWS), None)
    except Refused as exc:
        return [], f"the page does not read these dead-lettered rows: {exc}"
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
