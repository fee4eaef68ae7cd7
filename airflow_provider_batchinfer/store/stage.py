"""Stage locations, run keys and the commit protocol's marker.

Shared by both sides (the operator checks and clears a run directory; the runtime writes parts and
the marker), so it imports neither Airflow nor Ray. Files go through pyarrow's filesystem layer,
the same one Ray Data reads and writes with, so a location means the same thing on both sides.

Layout of one run directory::

    <run dir>/_job.json                     the job spec (the contract), written by the operator
    <run dir>/_input/<attempt>/*.parquet    a query's result or an Iceberg input's pinned snapshot,
                                            written by the job
    <run dir>/part-<block>-<attempt>.parquet predictions
    <run dir>/_errors/part-*.parquet        dead-lettered rows (ids + error), JobSpec(on_error="dead_letter")
    <run dir>/_SUCCESS                      JSON manifest, written last; readers trust only its files
    <run dir>/_claims/<attempt>/            local stores: the claiming attempt's commit token, an
                                            empty directory (``fence``), gone once it committed
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import uuid
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
    ManifestError,
    attempt_of,
    is_part_name,
    new_attempt_id,
    part_name,
)

if TYPE_CHECKING:
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
    "is_part_name",
    "is_uri",
    "join",
    "new_attempt_id",
    "part_name",
    "resolve_location",
    "sanitize_run_key",
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
                from airflow_provider_batchinfer.store import s3

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
        from airflow_provider_batchinfer.store.s3 import translate_errors

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
        # insertion order, not sorted keys: a model signature's column order is its feature order
        self.write_bytes(json.dumps(obj, indent=2, default=str).encode("utf-8"))

    def delete(self) -> None:
        import pyarrow.fs as pafs

        with self._io("delete"):
            info = self.fs.get_file_info(self.path)
            if info.type == pafs.FileType.File:
                self.fs.delete_file(self.path)
            elif info.type == pafs.FileType.Directory:
                self.fs.delete_dir(self.path)

    def clear_run_directory(self) -> int:
        """Empty a run directory for OVERWRITE: the claim is revoked first, so no earlier attempt
        can commit from then on (``fence``; one that committed before is removed next); then
        ``_SUCCESS``, so a reader never sees an old marker beside new parts; then every other file.
        Returns how many files were removed.

        On S3 pyarrow lists ``<key>/`` (so ``run1`` never touches ``run10/``) and deletes in
        DeleteObjects batches of up to 1,000 keys; nothing relies on a rename."""
        import pyarrow.fs as pafs

        from airflow_provider_batchinfer.store.commit.fence import claims_for

        removed = len(self.list_files())
        claims_for(self).revoke()
        marker = self.child(SUCCESS_MARKER)
        if marker.exists():
            marker.delete()
        with self._io("delete the contents of"):
            if self.fs.get_file_info(self.path).type == pafs.FileType.Directory:
                self.fs.delete_dir_contents(self.path, missing_dir_ok=True)
        return removed


# reading and checking committed markers lives in markers.py; these names stay importable from here
_MARKER_NAMES = frozenset(
    {
        "as_manifest",
        "committed_files",
        "dead_letter_files",
        "file_sha256",
        "read_committed",
        "read_valid_manifest",
        "validate_manifest",
    }
)


def __getattr__(name: str) -> Any:
    if name in _MARKER_NAMES:
        from airflow_provider_batchinfer.store.commit import markers

        return getattr(markers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
