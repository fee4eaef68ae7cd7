"""A location opened: the filesystem and path a location string names, and what is read and written
there. The string rules (joining, run keys, ``StageError``) are ``locations.py``; the claim, the
marker and the run directory's lifecycle are ``commit/``.

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

import json
import posixpath
import uuid
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.store import s3
from airflow_provider_batchinfer.store.locations import is_uri, join

if TYPE_CHECKING:
    import pyarrow.fs as pafs


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
        return s3.translate_errors(self.location, operation)

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

    def delete_contents(self) -> None:
        """Remove everything below this location, keeping the directory (gone or absent: nothing)."""
        import pyarrow.fs as pafs

        with self._io("delete the contents of"):
            if self.fs.get_file_info(self.path).type == pafs.FileType.Directory:
                self.fs.delete_dir_contents(self.path, missing_dir_ok=True)
