"""Parts carry the sha256 of their bytes: computed while written (never read back), and, for the
parts RESUME keeps from an earlier attempt, from the one read that validates them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_batchinfer.contract import FileEntry
from airflow_provider_batchinfer.runtime.output.parts import HashingSink, _PartWriter
from airflow_provider_batchinfer.runtime.rows.done_set import DoneSet
from airflow_provider_batchinfer.runtime.rows.resume import collect_committed
from airflow_provider_batchinfer.store.stage import Stage


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_part_writer_hashes_and_counts_the_bytes_as_it_writes_them(tmp_path):
    local = Stage.open(str(tmp_path))
    reads: list[str] = []

    class WriteOnly:  # the local filesystem, recording any attempt to read
        def __getattr__(self, name):
            if name.startswith(("open_input", "get_file_info")):
                reads.append(name)
            return getattr(local.fs, name)

    run_dir = Stage(local.location, WriteOnly(), local.path)
    part = _PartWriter(run_dir.child("part-00003-t01abc.parquet"), "part-00003-t01abc.parquet")
    part.write(pa.table({"id": pa.array(range(1000), pa.int64()), "text": [f"row {i}" for i in range(1000)]}))
    part.write(pa.table({"id": pa.array([1000], pa.int32()), "text": ["last"]}))  # cast to the first schema
    entry = part.close()
    path = tmp_path / "part-00003-t01abc.parquet"
    assert entry == FileEntry("part-00003-t01abc.parquet", size=path.stat().st_size, rows=1001, sha256=_sha(path))
    assert pq.read_table(path).num_rows == 1001 and not reads  # hashed on the way out, never read back
    dead = _PartWriter(run_dir.child("_errors", "part-00003-t01abc.parquet"), "_errors/part-00003-t01abc.parquet")
    assert dead.close() is None and not (tmp_path / "_errors").exists()  # nothing written, no empty file


def test_a_part_dictionary_encodes_labels_and_strings_but_writes_floats_and_lists_plain(tmp_path):
    """Scores and embeddings almost never repeat: a dictionary for them is built, then abandoned,
    and the file comes out larger. Labels, categories and ids keep theirs."""
    import numpy as np

    rows = 20_000
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": pa.array(np.arange(rows)),
            "label": pa.array(rng.integers(0, 3, rows)),
            "color": pa.array(rng.choice(["red", "green"], rows)),
            "score": pa.array(rng.random(rows).astype(np.float32)),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * 4)), 4),
        }
    )
    part = _PartWriter(Stage.open(str(tmp_path / "part-00000-t01abc.parquet")), "part-00000-t01abc.parquet")
    part.write(table)
    part.close()
    meta = pq.ParquetFile(tmp_path / "part-00000-t01abc.parquet").metadata.row_group(0)
    dictionary = {meta.column(i).path_in_schema: meta.column(i).has_dictionary_page for i in range(meta.num_columns)}
    assert dictionary == {
        "id": True,
        "label": True,
        "color": True,
        "score": False,
        "embedding.list.element": False,
    }
    assert pq.read_table(tmp_path / "part-00000-t01abc.parquet").equals(table)


def test_hashing_sink_forwards_every_byte():
    import io

    out = io.BytesIO()
    sink = HashingSink(out)
    for chunk in (b"PAR1", bytearray(b"abc"), memoryview(b"defgh")):
        sink.write(chunk)
    assert sink.tell() == sink.size == 12 and out.getvalue() == b"PAR1abcdefgh"
    assert sink.sha256 == hashlib.sha256(b"PAR1abcdefgh").hexdigest()


def test_resume_hashes_the_parts_it_keeps_from_the_read_that_checks_them(tmp_path):
    pq.write_table(pa.table({"ticket_id": [1, 2], "text": ["a", "b"]}), tmp_path / "part-00000-t01a.parquet")
    (tmp_path / "_errors").mkdir()
    pq.write_table(
        pa.table({"ticket_id": [9], "error": ["ValueError: x"]}), tmp_path / "_errors" / "part-00000-t01a.parquet"
    )
    whole = (tmp_path / "part-00000-t01a.parquet").read_bytes()
    (tmp_path / "part-00001-t01a.parquet").write_bytes(whole[: len(whole) // 2])  # cut off mid-write
    with DoneSet() as done:
        kept = collect_committed(Stage.open(str(tmp_path)), "ticket_id", done, attempts=("t01a",))
        assert done.rows == 3  # the kept part's ids and the dead-letter file's
    assert kept["files"] == [
        FileEntry("part-00000-t01a.parquet", len(whole), 2, _sha(tmp_path / "part-00000-t01a.parquet"))
    ]
    (error,) = kept["error_files"]
    assert error.name == "_errors/part-00000-t01a.parquet" and error.rows == 1
    assert error.sha256 == _sha(tmp_path / "_errors" / "part-00000-t01a.parquet")
    assert kept["removed"] == ["part-00001-t01a.parquet"]
