"""Reading tables: a committed run (the sensor, ``read_committed``), and pinning an input's snapshot
(the job reads it: ``runtime/inputs/table_input.py``).

A run is committed when the table's history (the current snapshot and its ancestors) holds a
snapshot whose summary names its run key; that snapshot points at the run's manifest, which is
checked against the data files it lists (names, sizes, Parquet footers; checksums when asked),
against the snapshot (files and rows added, the attempt) and against the run's claim (``_job.json``
in its claim directory must be there and name the snapshot's attempt: a snapshot that landed as a
newer try claimed the run is rolled back, and is not the run's commit meanwhile).

Anyone who can commit to the connection's catalog can write a snapshot summary, and a job writes
the manifest, so neither chooses what this process opens: the manifest the summary names, and the
run and claim directories the manifest names, must each lie below one of the connection's roots
(``stage_root``, ``registry_root``, the catalog's warehouse: :func:`read_roots`, carried in the
options under :data:`ROOTS_OPTION`), in a scheme that root uses, and are opened from that root with
the connection's storage settings (``roots.open_placed``). Anything else is refused
(``roots.Refused``, a StageError: a sensor fails for good, the run page says so) before it is read.
Storage layer: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import Manifest, ManifestError
from airflow_provider_batchinfer.contract.specs.tables import parse_run_location
from airflow_provider_batchinfer.contract.tables import RUN_KEY_COLUMN, SUMMARY_PREFIX, TableInput
from airflow_provider_batchinfer.store.commit.markers import check_claim, validate_manifest
from airflow_provider_batchinfer.store.iceberg.catalog import CatalogError, open_catalog
from airflow_provider_batchinfer.store.locations import is_uri
from airflow_provider_batchinfer.store.redact import redact_uri
from airflow_provider_batchinfer.store.roots import Refused, Roots, open_placed, place
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table
    from pyiceberg.table.snapshots import Snapshot

#: the key under which options for ``iceberg://`` locations carry the catalog's properties
CATALOG_OPTION = "iceberg_catalog"
#: the key under which they carry the connection's roots (:func:`read_roots`)
ROOTS_OPTION = "batchinfer_roots"
#: the name a message gives the catalog's warehouse among the roots
WAREHOUSE_ROOT = "iceberg_catalog.warehouse"


def split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, str], dict[str, Any] | None]:
    """``(catalog properties, S3 storage options)`` out of the options a reader was given."""
    catalog = (options or {}).get(CATALOG_OPTION)
    if not catalog:
        raise CatalogError(f"reading an iceberg:// location needs the catalog's properties under {CATALOG_OPTION!r}")
    return dict(catalog), _storage(options)


def _storage(options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The S3 storage options among the options a reader was given."""
    storage = {k: v for k, v in (options or {}).items() if k not in (CATALOG_OPTION, ROOTS_OPTION)}
    return storage or None


def read_roots(stage_root: str, registry_root: str, catalog: Mapping[str, str]) -> dict[str, str]:
    """Where a table run may be read: the connection's ``stage_root`` and ``registry_root``, and the
    catalog's ``warehouse`` when the connection names one as a path or URI outside them (a REST
    catalog's warehouse is a name, and a warehouse that holds a credential is no root)."""
    roots = {"stage_root": stage_root, "registry_root": registry_root}
    warehouse = str(catalog.get("warehouse") or "")
    usable = (is_uri(warehouse) or warehouse.startswith(("/", "file:/"))) and redact_uri(warehouse) == warehouse
    if usable and not any(c in warehouse for c in "?#"):
        try:
            place(warehouse, roots)
        except Refused:
            roots[WAREHOUSE_ROOT] = warehouse.rstrip("/")
    return roots


def table_roots(options: Mapping[str, Any] | None) -> Roots:
    """The roots a reader was given (:data:`ROOTS_OPTION`); :class:`Refused` without them, so a
    caller that forgot them reads nothing rather than anything."""
    roots = (options or {}).get(ROOTS_OPTION)
    if not isinstance(roots, Mapping) or not any(isinstance(v, str) and v for v in roots.values()):
        raise Refused(
            f"reading an iceberg:// run needs the connection's roots under {ROOTS_OPTION!r} "
            "(ModelServiceHook.table_read_options() gives them with the catalog); nothing is read without them"
        )
    return {str(k): str(v) for k, v in roots.items() if isinstance(v, str) and v}


def open_below_roots(location: object, options: Mapping[str, Any] | None, what: str, where: str) -> Stage:
    """``location`` (``what``: which location a summary or manifest names) opened from the root it
    lies below, with the connection's storage settings; :class:`Refused` naming it, the roots and
    ``where`` it was found, before anything is opened."""
    roots = table_roots(options)
    storage = _storage(options)
    try:
        return open_placed(location, roots, lambda root: Stage.open(root, storage))
    except Refused as exc:
        raise Refused(f"{where}: {what} is refused, and nothing of it is read: {exc}") from None


def load_table(catalog: Catalog, identifier: str) -> Table | None:
    """The table, or None when it does not exist (yet)."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        return catalog.load_table(identifier)
    except (NoSuchTableError, NoSuchNamespaceError):
        return None


def run_snapshot(table: Table, run_key: str) -> Snapshot | None:
    """The newest snapshot in the table's current history that committed ``run_key``."""
    from pyiceberg.table.snapshots import ancestors_of

    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        if snapshot.summary is not None and snapshot.summary.get(SUMMARY_PREFIX + "run-key") == run_key:
            return snapshot
    return None


def run_files(table: Table, run_key: str) -> list[Any]:
    """The data files of ``run_key`` in the table's current snapshot (whole files: the run key is the
    table's partition)."""
    from pyiceberg.expressions import EqualTo

    if table.current_snapshot() is None:
        return []
    return [task.file for task in table.scan(row_filter=EqualTo(RUN_KEY_COLUMN, run_key)).plan_files()]


def _check_against_snapshot(manifest: Manifest, snapshot: Snapshot, where: str) -> None:
    summary = snapshot.summary
    if summary is None:
        raise ManifestError(f"{where}: the snapshot has no summary")
    attempt = summary.get(SUMMARY_PREFIX + "attempt")
    if attempt != manifest.job.attempt:
        raise ManifestError(
            f"{where}: the snapshot was committed by attempt {attempt}, the manifest by {manifest.job.attempt}"
        )
    added = (int(summary.get("added-data-files", "0")), int(summary.get("added-records", "0")))
    expected = (len(manifest.files), manifest.counts.output_rows)
    if added != expected:
        raise ManifestError(
            f"{where}: snapshot {snapshot.snapshot_id} added {added[0]} file(s) and {added[1]} row(s), but the "
            f"run's manifest lists {expected[0]} and {expected[1]}"
        )


def read_table_manifest(
    location: str, options: Mapping[str, Any] | None, *, verify_checksums: bool = False
) -> Manifest | None:
    """The validated manifest of a committed run (``iceberg://<table>/<run key>``), with the
    snapshot that committed it; None while the table or the run's snapshot does not exist."""

    identifier, run_key = parse_run_location(location)
    catalog_props, storage = split_options(options)
    table_roots(options)  # no roots, no read: not even the catalog
    table = load_table(open_catalog(catalog_props, storage), identifier)
    snapshot = None if table is None else run_snapshot(table, run_key)
    if table is None or snapshot is None:
        return None
    where = f"{location} (snapshot {snapshot.snapshot_id})"
    manifest_location = (snapshot.summary or {}).get(SUMMARY_PREFIX + "manifest")
    if not manifest_location:
        raise ManifestError(f"{where}: the snapshot names no batchinfer manifest")
    marker = open_below_roots(manifest_location, options, "the manifest its summary names", where)
    manifest = Manifest.from_json(marker.read_bytes(), marker.location)
    if manifest.table is None or (manifest.table.identifier, manifest.table.run_key) != (identifier, run_key):
        raise ManifestError(f"{where}: {manifest_location} is not the manifest of this table and run key")
    _check_against_snapshot(manifest, snapshot, where)
    # both directories the manifest names are placed before either is opened
    claim_dir = open_below_roots(manifest.table.claim_dir, options, "the claim directory its manifest names", where)
    run_dir = open_run_dir(manifest, options, where)
    # the snapshot's attempt (checked equal to the manifest's) against the claim the provider keeps
    # for the run: a snapshot that landed as a newer try claimed the run is not the run's commit
    check_claim(claim_dir, manifest.job.attempt, where, expected=True)
    validate_manifest(run_dir, manifest, verify_checksums=verify_checksums)
    return dataclasses.replace(manifest, table=manifest.table.with_snapshot(snapshot.snapshot_id))


def open_run_dir(manifest: Manifest, options: Mapping[str, Any] | None, where: str | None = None) -> Stage:
    """The run directory a table run's manifest names (its data files, its ``_errors/``), opened
    from the connection's root it lies below; :class:`Refused` for any other."""
    return open_below_roots(
        manifest.run_dir,
        options,
        "the run directory its manifest names",
        where or f"the manifest of {manifest.run_dir}",
    )


def read_run_rows(manifest: Manifest, options: Mapping[str, Any] | None, columns: list[str] | None = None) -> pa.Table:
    """Exactly the rows ``manifest``'s run committed: its run key in the snapshot that committed it."""
    from pyiceberg.expressions import EqualTo

    target = manifest.table
    if target is None or target.snapshot_id is None:
        raise ManifestError(
            "this manifest names no committed table snapshot; read it from the sensor's XCom or the operator's "
            "output (read_table_manifest fills it in)"
        )
    catalog_props, storage = split_options(options)
    table = load_table(open_catalog(catalog_props, storage), target.identifier)
    if table is None:
        raise ManifestError(f"table {target.identifier} no longer exists")
    scan = table.scan(
        row_filter=EqualTo(RUN_KEY_COLUMN, target.run_key),
        snapshot_id=target.snapshot_id,
        selected_fields=tuple(columns) if columns else ("*",),
    )
    return scan.to_arrow()


def pin_input(catalog: Catalog, ref: TableInput, pinned: TableInput | None) -> TableInput:
    """The snapshot a run reads: the one given, else the one an earlier try of the run pinned (same
    table and filter), else the table's current snapshot."""
    if ref.snapshot_id is not None:
        snapshot_id: int | None = ref.snapshot_id
    elif pinned is not None and (pinned.identifier, pinned.row_filter) == (ref.identifier, ref.row_filter):
        snapshot_id = pinned.snapshot_id
    else:
        table = load_table(catalog, ref.identifier)
        if table is None:
            raise CatalogError(f"input table {ref.identifier} does not exist in the catalog")
        current = table.current_snapshot()
        if current is None:
            raise CatalogError(f"input table {ref.identifier} has no snapshot (no rows were ever committed)")
        snapshot_id = current.snapshot_id
    return dataclasses.replace(ref, snapshot_id=snapshot_id)
