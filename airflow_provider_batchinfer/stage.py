"""Stage locations, run keys and the commit protocol's marker.

Shared by both sides (the operator checks and clears a run directory; the runtime writes parts and
the marker), so it imports neither Airflow nor Ray. Files go through pyarrow's filesystem layer,
the same one Ray Data reads and writes with, so a location means the same thing on both sides.

Layout of one run directory::

    <run dir>/_job.json                     the job spec (the contract), written by the operator
    <run dir>/_input/part-*.parquet         materialized SQL input, when the input was a query
    <run dir>/part-<block>-<attempt>.parquet predictions
    <run dir>/_errors/part-*.parquet        dead-lettered rows (ids + error), JobSpec(on_error="dead_letter")
    <run dir>/_SUCCESS                      JSON manifest, written last; readers trust only its files
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import uuid
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# the layout names and the manifest live in the contract; re-exported here for existing imports
from airflow_provider_batchinfer.contract import (
    ERRORS_DIR,
    INPUT_DIR,
    JOB_SPEC_FILE,
    MANIFEST_FORMAT,
    SUCCESS_MARKER,
    FileEntry,
    Manifest,
    ManifestError,
    attempt_of,
    is_part_name,
    new_attempt_id,
    part_name,
)

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

__all__ = [
    "ERRORS_DIR",
    "INPUT_DIR",
    "JOB_SPEC_FILE",
    "MANIFEST_FORMAT",
    "SUCCESS_MARKER",
    "ManifestError",
    "Stage",
    "StageError",
    "attempt_of",
    "check_relative_path",
    "committed_files",
    "dead_letter_files",
    "file_sha256",
    "is_part_name",
    "is_uri",
    "join",
    "new_attempt_id",
    "part_name",
    "read_committed",
    "read_valid_manifest",
    "resolve_location",
    "sanitize_run_key",
    "validate_manifest",
]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class StageError(RuntimeError):
    """A stage location is unusable or a run directory is in a state we must not touch."""


def sanitize_run_key(run_id: str, max_len: int = 120) -> str:
    """Turn an Airflow run_id into one safe path segment, stable across tries of the same run.

    ``manual__2026-11-23T01:18:23.440778+00:00`` holds ``:`` and ``+``, which object stores and
    shells mangle. Replaced characters could make two run_ids collide, so whenever the text changes
    a short hash of the original is appended: distinct run_ids always get distinct directories.
    """
    if not isinstance(run_id, str) or not run_id.strip():
        raise StageError(f"cannot derive a run key from run_id={run_id!r}")
    clean = _UNSAFE.sub("_", run_id.strip()).strip("._-") or "run"
    if clean != run_id or len(clean) > max_len:
        digest = hashlib.sha1(run_id.encode("utf-8")).hexdigest()[:8]
        clean = f"{clean[: max_len - 9]}-{digest}"
    return clean


def check_relative_path(path: str, what: str) -> str:
    """Refuse ``..`` segments and absolute paths where a path must stay below a root."""
    if not isinstance(path, str) or not path:
        raise StageError(f"{what} must be a non-empty path, got {path!r}")
    parts = path.replace("\\", "/").split("/")
    if ".." in parts:
        raise StageError(f"{what}={path!r} contains '..'; paths may not climb out of their root")
    return path


def is_uri(location: str) -> bool:
    return "://" in location


def resolve_location(location: str, root: str | None) -> str:
    """Absolute paths and URIs stay as they are; a relative path is placed under ``root``.

    Every form refuses ``..`` segments, so a templated value cannot climb out of the stage root.
    """
    check_relative_path(location, "location")
    if is_uri(location) or location.startswith("/"):
        return location.rstrip("/") or "/"
    if not root:
        raise StageError(
            f"location {location!r} is relative but no stage root is configured; give an absolute path or "
            "URI, or set stage_root in the batchinfer connection's extras"
        )
    return join(root, location)


def join(location: str, *parts: str) -> str:
    for part in parts:
        check_relative_path(part, "path segment")
    if is_uri(location):
        scheme, rest = location.split("://", 1)
        return f"{scheme}://{posixpath.join(rest.rstrip('/'), *parts)}"
    return posixpath.join(location, *parts)


@dataclass(frozen=True)
class Stage:
    """A filesystem plus the path inside it, for one location string."""

    location: str
    fs: pafs.FileSystem
    path: str

    @classmethod
    def open(cls, location: str, storage_options: dict[str, Any] | None = None) -> Stage:
        import pyarrow.fs as pafs

        if is_uri(location) and not location.startswith("file://"):
            scheme = location.split("://", 1)[0]
            if scheme.lower() in ("s3", "s3a"):
                from airflow_provider_batchinfer import s3

                return cls(location, s3.filesystem(storage_options), location.split("://", 1)[1].rstrip("/"))
            fs, path = pafs.FileSystem.from_uri(location)
            return cls(location, fs, path.rstrip("/"))
        path = location[len("file://") :] if location.startswith("file://") else location
        return cls(location, pafs.LocalFileSystem(), path.rstrip("/") or "/")

    def child(self, *parts: str) -> Stage:
        return Stage(join(self.location, *parts), self.fs, posixpath.join(self.path, *parts))

    def _io(self, operation: str) -> AbstractContextManager[None]:
        """Object-store errors become a StageError naming bucket, key and operation; local ones pass."""
        if self.fs.type_name != "s3":
            return nullcontext()
        from airflow_provider_batchinfer.s3 import translate_errors

        return translate_errors(self.location, operation)

    # --- queries ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        import pyarrow.fs as pafs

        with self._io("look up"):
            return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        import pyarrow.fs as pafs

        with self._io("look up"):
            return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def list_files(self, recursive: bool = True) -> list[tuple[str, int]]:
        """(path relative to this location, size) of every file below it; [] when absent."""
        import pyarrow.fs as pafs

        with self._io("list"):
            info = self.fs.get_file_info(self.path)
            if info.type == pafs.FileType.NotFound:
                return []
            if info.type == pafs.FileType.File:
                return [(posixpath.basename(self.path), info.size)]
            selector = pafs.FileSelector(self.path, recursive=recursive, allow_not_found=True)
            items = self.fs.get_file_info(selector)
        prefix = self.path.rstrip("/") + "/"
        out = []
        for item in items:
            if item.type == pafs.FileType.File:
                out.append((item.path[len(prefix) :] if item.path.startswith(prefix) else item.path, item.size))
        return sorted(out)

    def is_empty(self) -> bool:
        return not self.list_files()

    # --- bytes and JSON ----------------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        with self._io("read"), self.fs.open_input_stream(self.path) as f:
            return f.read()

    def write_bytes(self, data: bytes) -> None:
        """Write a whole object. Locally via a temp file and rename, so readers never see half a file;
        object stores publish a PUT atomically on their own."""
        import pyarrow.fs as pafs

        parent = posixpath.dirname(self.path)
        if isinstance(self.fs, pafs.LocalFileSystem):
            self.fs.create_dir(parent, recursive=True)
            tmp = posixpath.join(parent, f".{posixpath.basename(self.path)}.{uuid.uuid4().hex[:8]}.tmp")
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, self.path)
        else:
            with self._io("write"), self.fs.open_output_stream(self.path) as f:
                f.write(data)

    def read_json(self) -> Any:
        return json.loads(self.read_bytes().decode("utf-8"))

    def write_json(self, obj: Any) -> None:
        self.write_bytes(json.dumps(obj, indent=2, sort_keys=True, default=str).encode("utf-8"))

    def delete(self) -> None:
        import pyarrow.fs as pafs

        with self._io("delete"):
            info = self.fs.get_file_info(self.path)
            if info.type == pafs.FileType.File:
                self.fs.delete_file(self.path)
            elif info.type == pafs.FileType.Directory:
                self.fs.delete_dir(self.path)

    def clear_run_directory(self) -> int:
        """Empty a run directory for OVERWRITE: ``_SUCCESS`` goes first, so a reader never sees an
        old marker beside new parts; then every other file. Returns how many files were removed.

        On S3 pyarrow lists ``<key>/`` (so ``run1`` never touches ``run10/``) and deletes in
        DeleteObjects batches of up to 1,000 keys; nothing relies on a rename."""
        import pyarrow.fs as pafs

        marker = self.child(SUCCESS_MARKER)
        had_marker = marker.exists()
        if had_marker:
            marker.delete()
        removed = len(self.list_files()) + int(had_marker)
        with self._io("delete the contents of"):
            if self.fs.get_file_info(self.path).type == pafs.FileType.Directory:
                self.fs.delete_dir_contents(self.path, missing_dir_ok=True)
        return removed


# --- the manifest against the files --------------------------------------------------------------------
ManifestLike = Manifest | Mapping[str, Any]
_CHUNK = 8 * 1024 * 1024
_FORMAT_1 = "batchinfer.manifest/1"


def as_manifest(manifest: ManifestLike, where: str = "manifest") -> Manifest:
    """A typed manifest from a :class:`Manifest` or its dict (an XCom value), validated on read."""
    return manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest, where)


def file_sha256(stage: Stage) -> str:
    """The sha256 of one file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with stage._io("read"), stage.fs.open_input_stream(stage.path) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _footer_rows(stage: Stage, size: int) -> int:
    """Rows in a Parquet file's footer, read from its last bytes only (a ranged read on S3). A file
    overwritten with anything but Parquet has no footer and raises ManifestError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tail = b""
    if size >= 12:
        with stage._io("read the Parquet footer of"), stage.fs.open_input_file(stage.path) as f:
            end = f.read_at(8, size - 8)
            length = int.from_bytes(end[:4], "little")
            if end[4:] == b"PAR1" and 0 < length <= size - 12:
                tail = f.read_at(length + 8, size - length - 8)
    try:
        if not tail:
            raise ValueError("Parquet magic bytes or footer length not found at the end of the file")
        return int(pq.read_metadata(pa.BufferReader(b"PAR1" + tail)).num_rows)
    except (ValueError, OSError) as exc:
        raise ManifestError(
            f"{stage.location} is not a readable Parquet file ({exc}); it was overwritten or truncated after the "
            f"commit. Do not use this output: re-run the task that wrote it"
        ) from exc


def _no_checksums(where: str, manifest: Manifest) -> ManifestError:
    return ManifestError(
        f"{where} is a {manifest.format} marker and records no checksums, so its files cannot be verified; read it "
        "with verify_checksums=False, or re-run the task to write a marker with checksums"
    )


def _check_entry(run_dir: Stage, entry: FileEntry, present: dict[str, int], verify_checksums: bool) -> None:
    check_relative_path(entry.name, "manifest file name")
    location = f"{run_dir.location}/{entry.name}"
    if entry.name not in present:
        raise ManifestError(f"{location} is listed in {SUCCESS_MARKER} but missing")
    if present[entry.name] != entry.size:
        raise ManifestError(f"{location} is {present[entry.name]} bytes but {SUCCESS_MARKER} says {entry.size}")
    part = run_dir.child(*entry.name.split("/"))
    rows = _footer_rows(part, entry.size)
    if rows != entry.rows:
        raise ManifestError(f"{location} holds {rows} rows but {SUCCESS_MARKER} says {entry.rows}")
    if verify_checksums:
        if entry.sha256 is None:
            raise ManifestError(f"{location} has no sha256 in {SUCCESS_MARKER}; it cannot be verified")
        _compare_sha256(location, file_sha256(part), entry.sha256)


def _compare_sha256(location: str, actual: str, expected: str) -> None:
    if actual != expected:
        raise ManifestError(
            f"{location} does not match its sha256 in {SUCCESS_MARKER} (file {actual[:16]}…, manifest "
            f"{expected[:16]}…): it changed after the commit. Do not use this output: re-run the task that wrote it"
        )


def validate_manifest(run_dir: Stage, manifest: ManifestLike, *, verify_checksums: bool = False) -> None:
    """Check that a manifest describes the files beside it: its schema (``Manifest.from_dict``), its
    counts, and for every listed file (outputs and dead letters) its name, size and Parquet footer
    (row count); with ``verify_checksums`` also each file's sha256. Raises ManifestError naming the
    first problem (a StageError for a name that climbs out of the run directory)."""
    where = f"{run_dir.location}/{SUCCESS_MARKER}"
    manifest = as_manifest(manifest, where)
    manifest.check_counts(where)
    if verify_checksums and manifest.format == _FORMAT_1:
        raise _no_checksums(where, manifest)
    present = dict(run_dir.list_files())
    for entry in manifest.files + manifest.error_files:
        _check_entry(run_dir, entry, present, verify_checksums)


def read_valid_manifest(
    location: str, storage_options: dict[str, Any] | None = None, *, verify_checksums: bool = False
) -> Manifest | None:
    """The validated manifest of a run directory, or None while it has no marker."""
    run_dir = Stage.open(location, storage_options)
    marker = run_dir.child(SUCCESS_MARKER)
    if not marker.exists():
        return None
    manifest = Manifest.from_json(marker.read_bytes(), marker.location)
    validate_manifest(run_dir, manifest, verify_checksums=verify_checksums)
    return manifest


def committed_files(manifest: ManifestLike) -> list[str]:
    """Full locations of the files a manifest commits: what ``publish`` should read, and nothing else."""
    m = as_manifest(manifest)
    return [join(m.run_dir, *entry.name.split("/")) for entry in m.files]


def dead_letter_files(manifest: ManifestLike) -> list[str]:
    """Full locations of the dead-lettered rows a manifest lists (``_errors/``): ids + error message."""
    m = as_manifest(manifest)
    return [join(m.run_dir, *entry.name.split("/")) for entry in m.error_files]


def read_committed(
    manifest: ManifestLike,
    storage_options: dict[str, Any] | None = None,
    columns: list[str] | None = None,
    verify_checksums: bool = True,
) -> pa.Table:
    """The committed predictions as one ``pyarrow.Table``: exactly the files the manifest lists, read
    through the stage's own filesystem, so an ``s3://`` run directory on a custom endpoint (MinIO,
    R2) reads with the connection's settings (``ModelServiceHook.read_committed`` passes them).

    With ``verify_checksums`` (the default) each file is read once, hashed and parsed from the same
    bytes, so what is returned is exactly what was committed; a file that changed raises
    ManifestError. A format-1 manifest has no checksums: read it with ``verify_checksums=False``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    m = as_manifest(manifest)
    run_dir = Stage.open(m.run_dir, storage_options)
    if not m.files:
        raise ManifestError(f"{run_dir.location}/{SUCCESS_MARKER} commits no files; there is nothing to read")
    if verify_checksums and m.format == _FORMAT_1:
        raise _no_checksums(f"{run_dir.location}/{SUCCESS_MARKER}", m)
    tables = []
    for entry in m.files:
        check_relative_path(entry.name, "manifest file name")
        data = run_dir.child(*entry.name.split("/")).read_bytes()
        location = f"{run_dir.location}/{entry.name}"
        if len(data) != entry.size:
            raise ManifestError(f"{location} is {len(data)} bytes but {SUCCESS_MARKER} says {entry.size}")
        if verify_checksums:
            if entry.sha256 is None:
                raise ManifestError(f"{location} has no sha256 in {SUCCESS_MARKER}; it cannot be verified")
            _compare_sha256(location, hashlib.sha256(data).hexdigest(), entry.sha256)
        try:
            tables.append(pq.read_table(pa.BufferReader(data), columns=columns))
        except (ValueError, OSError) as exc:
            raise ManifestError(
                f"{location} is not a readable Parquet file ({exc}); re-run the task that wrote it"
            ) from exc
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
