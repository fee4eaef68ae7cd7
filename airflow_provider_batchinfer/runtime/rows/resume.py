"""SaveMode.RESUME on the Ray side: keep what earlier attempts committed, score only the rest.

A preempted attempt leaves complete parts (each one a whole Parquet file with its footer, written
by one Ray write task) and perhaps one part cut off mid-write (no footer). The next attempt of the
same run keeps the complete parts of the attempts its claim lists as resumable (one lineage of the
same result; part names carry their attempt), deletes every other attempt's (part writes are not
fenced: a zombie's late part may sit here) and the cut-off ones, finds which input rows the kept
parts hold (by ``InputSpec.id_column``; the newest attempt's part wins where two overlap) and
reads only the others, so each row ends up in exactly one listed file of the final manifest. The operator decides whether resuming is allowed (the same
task instance and result identity: input content, model, params, engine, columns, output schema
and part boundaries; see ``rundir.prepare``); this module only reads and filters.

The earlier attempt recorded nothing about its parts (it died before its commit), so their sizes
and sha256 checksums for the manifest are computed here, from the same single read that checks
each part's footer and collects its ids: every kept part is read once, never twice.

Cost: the kept ids are spilled to local disk by hash partition (``done_set.py``), never held
whole in the driver's or the workers' memory. Matching the input's id column against them
partition by partition finds the done rows per input file: a file without any is read as it is, a
file with only done rows is skipped, and the other rows of a partly done file are copied once
into ``<run dir>/_resume/<attempt>/``, which both engines read in its place and the attempt
removes before it commits.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from airflow_provider_batchinfer.contract import ERRORS_DIR, FileEntry, attempt_of
from airflow_provider_batchinfer.runtime.rows.done_set import BATCH_ROWS, DoneSet
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.contract import JobFile

_PART = re.compile(rf"^(?:{ERRORS_DIR}/)?part-[^/]+\.parquet$")
#: where a resumed attempt copies the rows still to score of partly done input files
REMAINING_DIR = "_resume"


class ResumeError(RuntimeError):
    """The kept parts cannot be trusted for a resume; the message says what to do."""


@dataclass(frozen=True)
class RemainingInput:
    """The files a resumed attempt reads instead of the input's: untouched input files as they
    are, and the rows still to score of partly done ones (under ``_resume/<attempt>/``)."""

    files: list[str]
    groups: list[list[int]]  # each file's rows per row group


class KeptParts(TypedDict):
    """What earlier attempts left that this one keeps: parts and dead-letter files (with their
    checksums), their rows, the names of the parts deleted, what is left to read (None: the
    whole input) and the seconds finding it took (None: not resuming)."""

    files: list[FileEntry]
    error_files: list[FileEntry]
    rows: int
    error_rows: int
    removed: list[str]
    numbers: dict[str, int]  # each kept file's number in the done set
    read: RemainingInput | None
    resume_s: float | None


def nothing_kept() -> KeptParts:
    return {
        "files": [],
        "error_files": [],
        "rows": 0,
        "error_rows": 0,
        "removed": [],
        "numbers": {},
        "read": None,
        "resume_s": None,
    }


def _read_part(part: Stage, id_column: str) -> tuple[pa.ChunkedArray, str, int]:
    """(ids, sha256, size) of one part from a single read: the bytes are hashed, then parsed from
    memory (footer check and id column). Raises ResumeError when the part has no id column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with part.fs.open_input_stream(part.path) as f:
        data = f.read()
    pf = pq.ParquetFile(pa.BufferReader(data))
    if id_column not in pf.schema_arrow.names:
        raise ResumeError(
            f"{part.location} has no column {id_column!r} (InputSpec.id_column), so its rows cannot be "
            "matched to the input; re-run with SaveMode.OVERWRITE"
        )
    return pf.read(columns=[id_column]).column(id_column), hashlib.sha256(data).hexdigest(), len(data)


def collect_committed(
    run_dir: Stage, id_column: str, done: DoneSet | None = None, *, attempts: Sequence[str]
) -> KeptParts:
    """The complete parts in ``run_dir`` of the resumable ``attempts`` (the claim's lineage, oldest
    first: ``JobFile.resumable_attempts``), with their checksums; their ids go into ``done``.

    A part of any other attempt is deleted: it was scored for another result, or it is the late
    write of a zombie that lost its claim, and either way its rows are not this result's. Each part
    kept is read once (hashed and parsed from the same bytes). A part without a readable footer was
    cut off mid-write: it is deleted (its rows are scored again). The parts are numbered newest
    attempt first, so where two hold the same id the newer attempt's is kept and the other deleted;
    given a ``done`` set, that check is the caller's (:func:`drop_shared`, which ``resume_state``
    runs only when needed)."""
    kept = nothing_kept()
    own = done is None
    store = DoneSet() if done is None else done
    rank = {attempt: n for n, attempt in enumerate(attempts)}
    try:
        for rel, size in _lineage_parts(run_dir, rank, kept):
            part = run_dir.child(*rel.split("/"))
            try:
                ids, sha256, size = _read_part(part, id_column)
            except ResumeError:
                raise
            except Exception as exc:  # no footer / truncated: the write task died mid-file
                part.delete()
                kept["removed"].append(rel)
                print(
                    f"[batchinfer] resume: removed {rel} ({size:,} bytes): cut off mid-write "
                    f"({type(exc).__name__}); its rows are scored again",
                    flush=True,
                )
                continue
            kept["numbers"][rel] = len(kept["numbers"])
            store.add(kept["numbers"][rel], ids)
            entry = FileEntry(name=rel, size=size, rows=len(ids), sha256=sha256)
            (kept["error_files"] if rel.startswith(ERRORS_DIR + "/") else kept["files"]).append(entry)
        _recount(kept)
        if own:
            drop_shared(run_dir, kept, store)
    finally:
        if own:
            store.close()
    return kept


def _lineage_parts(run_dir: Stage, rank: dict[str, int], kept: KeptParts) -> list[tuple[str, int]]:
    """The parts of the ranked attempts, newest attempt first; every other part is deleted."""
    parts = []
    for rel, size in run_dir.list_files():
        if not _PART.match(rel):
            continue
        attempt = attempt_of(rel)
        if attempt in rank:
            parts.append((rel, size))
            continue
        run_dir.child(*rel.split("/")).delete()
        kept["removed"].append(rel)
        print(
            f"[batchinfer] resume: removed {rel}: attempt {attempt or '(none)'} is not one the claim lists as "
            "resumable (it computed another result, or wrote after it lost its claim); its rows are scored again",
            flush=True,
        )
    return sorted(parts, key=lambda item: (-rank[attempt_of(item[0]) or ""], item[0]))


def _recount(kept: KeptParts) -> None:
    kept["rows"] = sum(f.rows for f in kept["files"])
    kept["error_rows"] = sum(f.rows for f in kept["error_files"])


def drop_shared(run_dir: Stage, kept: KeptParts, done: DoneSet) -> None:
    """Delete each kept part that holds an id of a part numbered before it (newer attempts are
    numbered first: :func:`collect_committed`, so the newest attempt's part wins), and forget its
    ids: its rows are scored again."""
    earlier: dict[int, set[int]] = {}
    for later, first in done.shared():
        earlier.setdefault(later, set()).add(first)
    gone: set[int] = set()
    for number in sorted(kept["numbers"].values()):
        if any(n not in gone for n in earlier.get(number, ())):
            gone.add(number)
    if not gone:
        return
    for rel, number in list(kept["numbers"].items()):
        if number in gone:
            run_dir.child(*rel.split("/")).delete()
            kept["removed"].append(rel)
            del kept["numbers"][rel]
            print(f"[batchinfer] resume: removed {rel}: it repeats rows of a newer attempt's part", flush=True)
    kept["files"] = [f for f in kept["files"] if f.name in kept["numbers"]]
    kept["error_files"] = [f for f in kept["error_files"] if f.name in kept["numbers"]]
    _recount(kept)
    done.drop(gone)


def resume_state(
    job: JobFile,
    run_dir: Stage,
    files: Sequence[str] = (),
    file_groups: Sequence[Sequence[int]] = (),
    columns: Sequence[str] = (),
) -> KeptParts:
    """What earlier attempts of this run left to keep (``SaveMode.RESUME``, ``job.resume``), or
    nothing; with the input's ``files`` (their rows per row group, and the ``columns`` the job
    reads), what this attempt still reads.

    Fenced first: a late zombie must not delete (cut-off) parts in a directory another attempt owns."""
    if not job.resume:
        return nothing_kept()
    from airflow_provider_batchinfer.runtime.errors import JobError
    from airflow_provider_batchinfer.store.commit.rundir import FencedError, check_fence

    id_column = job.input_spec.id_column
    if not id_column:
        raise JobError("SaveMode.RESUME needs InputSpec.id_column to know which rows are done")
    try:
        check_fence(run_dir, job.attempt)
    except FencedError as exc:
        raise FencedError(f"attempt {job.attempt} does not own {run_dir.location}; not resuming ({exc})") from exc
    started = time.monotonic()
    leftovers = run_dir.child(REMAINING_DIR)  # copies of earlier attempts: this one makes its own
    if leftovers.list_files():
        leftovers.delete()
    storage = dict(job.storage_options) or None
    with DoneSet() as done:
        kept = collect_committed(run_dir, id_column, done, attempts=job.resumable_attempts)
        input_rows = sum(sum(groups) for groups in file_groups)
        per_file = done.match(list(files), id_column, storage, input_rows) if files and done.rows else {}
        if sum(per_file.values()) != done.rows:  # input ids are unique: only shared ids miss the count
            drop_shared(run_dir, kept, done)
            per_file = done.match(list(files), id_column, storage, input_rows) if files and done.rows else {}
        if per_file:
            kept["read"] = _remaining(job, run_dir, files, file_groups, columns, per_file, done)
    kept["resume_s"] = round(time.monotonic() - started, 3)
    left = "the whole input" if kept["read"] is None else f"{len(kept['read'].files)} file(s)"
    print(
        f"[batchinfer] resume: keeping {len(kept['files'])} part(s) with {kept['rows']:,} row(s) and "
        f"{len(kept['error_files'])} dead-letter file(s) with {kept['error_rows']:,} row(s) from earlier attempts; "
        f"reading {left} for the rest (done set: {kept['resume_s']:.3f} s)",
        flush=True,
    )
    return kept


def _scheme(location: str) -> str:
    return location.split("://", 1)[0] if "://" in location else "file"


def _remaining(
    job: JobFile,
    run_dir: Stage,
    files: Sequence[str],
    file_groups: Sequence[Sequence[int]],
    columns: Sequence[str],
    per_file: dict[int, int],
    done: DoneSet,
) -> RemainingInput:
    """The files to read: untouched input files, and copies of the rest of partly done ones. Where
    the run directory is on another store than the input, every file with rows left is copied, so
    one filesystem reads them all."""
    storage = dict(job.storage_options) or None
    rows_of = [sum(groups) for groups in file_groups]
    left = [i for i in range(len(files)) if per_file.get(i, 0) < rows_of[i]]
    same_store = _scheme(run_dir.location) == _scheme(files[0])
    copy = [i for i in left if per_file.get(i, 0) or not same_store]
    dest = run_dir.child(REMAINING_DIR, job.attempt)
    dest.fs.create_dir(dest.path, recursive=True)
    copies: dict[int, Stage] = {}
    pending = itertools.groupby(done.done_rows(copy), key=lambda item: item[0])
    current = next(pending, None)
    for i in copy:
        chunks: Iterator[Any] = iter(())
        if current is not None and current[0] == i:
            chunks = (rows for _, rows in current[1])
        copies[i] = dest.child(f"rest-{i:05d}.parquet")
        _copy_rest(Stage.open(files[i], storage), copies[i], columns, chunks)
        if current is not None and current[0] == i:
            current = next(pending, None)
    read = [
        (copies[i].location, _row_groups(copies[i])) if i in copies else (files[i], list(file_groups[i])) for i in left
    ]
    if not read:  # every row is done: one empty file, so both engines read (and score) nothing
        empty = dest.child("rest-empty.parquet")
        _copy_rest(Stage.open(files[0], storage), empty, columns, iter(()), schema_only=True)
        read = [(empty.location, _row_groups(empty))]
    return RemainingInput([f for f, _ in read], [g for _, g in read])


def _copy_rest(
    source: Stage, dest: Stage, columns: Sequence[str], done_rows: Iterator[Any], schema_only: bool = False
) -> None:
    """Copy the ``columns`` of the rows of ``source`` whose numbers ``done_rows`` (sorted numpy
    arrays) does not hold into ``dest``, one record batch at a time (``schema_only``: no rows)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    waiting = np.empty(0, np.int64)
    offset = 0
    with source.fs.open_input_file(source.path) as f, dest.fs.open_output_stream(dest.path) as out:
        pf = pq.ParquetFile(f)
        wanted = set(columns)
        schema = pa.schema([field for field in pf.schema_arrow if field.name in wanted])
        with pq.ParquetWriter(out, schema) as writer:
            batches = iter(()) if schema_only else pf.iter_batches(batch_size=BATCH_ROWS, columns=list(schema.names))
            for batch in batches:
                end = offset + batch.num_rows
                while not len(waiting) or waiting[-1] < end:
                    chunk = next(done_rows, None)
                    if chunk is None:
                        break
                    waiting = np.concatenate([waiting, chunk])
                k = int(np.searchsorted(waiting, end))
                here, waiting = waiting[:k] - offset, waiting[k:]
                if len(here):
                    keep = np.ones(batch.num_rows, dtype=bool)
                    keep[here] = False
                    batch = batch.filter(pa.array(keep))
                if batch.num_rows:
                    writer.write_batch(batch)
                offset = end


def _row_groups(stage: Stage) -> list[int]:
    import pyarrow.parquet as pq

    with stage.fs.open_input_file(stage.path) as f:
        meta = pq.read_metadata(f)
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def discard_remaining(run_dir: Stage, attempt: str) -> None:
    """Remove the copies this attempt read (``_resume/<attempt>/``): they are no output."""
    copies = run_dir.child(REMAINING_DIR, attempt)
    if copies.list_files():
        copies.delete()
