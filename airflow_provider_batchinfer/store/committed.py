"""A committed run, read back: its validated manifest and its rows, wherever it was committed (a run
directory's ``_SUCCESS``, checked by ``commit/markers.py``, or an Iceberg table's snapshot, read by
``iceberg/read.py``). Every reader of a committed run (the hook, the sensor and its trigger, the
runs pages, lineage, incremental scoring) starts here. Storage layer: imports neither Airflow nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import Manifest
from airflow_provider_batchinfer.contract.tables import TABLE_SCHEME
from airflow_provider_batchinfer.store.commit.markers import (
    ManifestLike,
    as_manifest,
    read_directory_manifest,
    read_directory_rows,
    verify_contents,
)
from airflow_provider_batchinfer.store.commit.verdicts import Verdicts
from airflow_provider_batchinfer.store.iceberg import read as table_read

if TYPE_CHECKING:
    import pyarrow as pa


def read_valid_manifest(
    location: str,
    storage_options: dict[str, Any] | None = None,
    *,
    verify_checksums: bool = False,
    verdicts: Verdicts | None = None,
) -> Manifest | None:
    """The validated manifest of a committed run, or None while there is none: a run directory's
    ``_SUCCESS`` (:func:`~airflow_provider_batchinfer.store.commit.markers.read_directory_manifest`),
    or for an ``iceberg://<table>/<run key>`` location the run's snapshot in the table. With
    ``verdicts``, files already checked for these very marker bytes are not read again."""
    if location.startswith(TABLE_SCHEME):
        return _read_table_manifest(location, storage_options, verify_checksums, verdicts)
    return read_directory_manifest(location, storage_options, verify_checksums=verify_checksums, verdicts=verdicts)


def _read_table_manifest(
    location: str, options: dict[str, Any] | None, verify_checksums: bool, verdicts: Verdicts | None
) -> Manifest | None:
    """The Iceberg side of :func:`read_valid_manifest`: the snapshot's manifest (its JSON) is the marker."""
    if verdicts is None or not verify_checksums:
        return table_read.read_table_manifest(location, options, verify_checksums=verify_checksums)
    manifest = table_read.read_table_manifest(location, options, verify_checksums=False)
    if manifest is None:
        return None
    storage = table_read.split_options(options)[1]
    key = verdicts.key(location, manifest.to_json().encode(), storage, verify_checksums=True)
    if not verdicts.holds(key):
        verify_contents(table_read.open_run_dir(manifest, options), manifest)  # from the root it was placed below
        verdicts.add(key)
    return manifest


def read_committed(
    manifest: ManifestLike,
    storage_options: dict[str, Any] | None = None,
    columns: list[str] | None = None,
    verify_checksums: bool = True,
) -> pa.Table:
    """The committed predictions as one ``pyarrow.Table``: exactly the files the manifest lists, read
    through the stage's own filesystem, so an ``s3://`` run directory on a custom endpoint (MinIO,
    R2) reads with the connection's settings (``ModelServiceHook.read_committed`` passes them); a
    table run's rows from the snapshot that committed them.

    With ``verify_checksums`` (the default) each file is read once, hashed and parsed from the same
    bytes, so what is returned is exactly what was committed; a file that changed raises
    ManifestError. A format-1 manifest has no checksums: read it with ``verify_checksums=False``."""
    m = as_manifest(manifest)
    if m.table is not None:
        return table_read.read_run_rows(m, storage_options, columns)
    return read_directory_rows(m, storage_options, columns, verify_checksums)
