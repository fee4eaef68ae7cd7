"""Damage that a footer check cannot see, and a filesystem that counts the bytes read, for the tests
that prove the readers check content (tests/e2e/test_sensor.py, tests/unit/test_reuse_source.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq


def flip_data_page_byte(path: Path) -> int:
    """Flip one bit of the last byte of the last column's data page in row group 0: the file keeps
    its size and its footer (so it still reads as the same rows), only its content differs.
    Returns the offset flipped."""
    meta = pq.read_metadata(path)
    footer_start = path.stat().st_size - 8 - int.from_bytes(path.read_bytes()[-8:-4], "little")
    chunk = meta.row_group(0).column(meta.num_columns - 1)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    offset = start + chunk.total_compressed_size - 1  # pages are contiguous: this is in the last data page
    assert chunk.data_page_offset <= offset < footer_start
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    assert pq.read_metadata(path).num_rows == meta.num_rows
    return offset


class _Counted:
    """A file object that adds every byte it returns to ``counts[path]``."""

    def __init__(self, f: Any, path: str, counts: Counter[str]) -> None:
        self.f, self.path, self.counts = f, path, counts
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        data = self.f.read() if n is None or n < 0 else self.f.read(n)
        self.counts[self.path] += len(data)
        return bytes(data)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def close(self) -> None:
        self.closed = True
        self.f.close()


class CountingHandler(pafs.FileSystemHandler):
    """The local filesystem, read-only, counting the bytes read from each path."""

    def __init__(self, counts: Counter[str]) -> None:
        self.fs = pafs.LocalFileSystem()
        self.counts = counts

    def get_type_name(self) -> str:
        return "counting"

    def equals(self, other: Any) -> bool:
        return other is self

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.fs.get_file_info(selector)

    def open_input_stream(self, path: str) -> pa.PythonFile:
        return pa.PythonFile(_Counted(self.fs.open_input_stream(path), path, self.counts), mode="r")

    def open_input_file(self, path: str) -> pa.PythonFile:
        return pa.PythonFile(_Counted(self.fs.open_input_file(path), path, self.counts), mode="r")

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the counting filesystem only reads")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _read_only
    move = copy_file = open_output_stream = open_append_stream = _read_only


def count_reads(monkeypatch: Any) -> Counter[str]:
    """From now on every local ``Stage`` reads through a :class:`CountingHandler`; the counts of
    bytes read per path are returned (a ``Counter``, filled as reads happen)."""
    from airflow_provider_batchinfer.store.stage import Stage

    counts: Counter[str] = Counter()
    opened = Stage.open.__func__  # type: ignore[attr-defined]

    def counting_open(cls: type[Stage], location: str, storage_options: dict[str, Any] | None = None) -> Stage:
        stage = opened(cls, location, storage_options)
        if isinstance(stage.fs, pafs.LocalFileSystem):
            stage = Stage(stage.location, pafs.PyFileSystem(CountingHandler(counts)), stage.path)
        return stage

    monkeypatch.setattr(Stage, "open", classmethod(counting_open))
    return counts
