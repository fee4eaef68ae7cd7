"""The input of a job: which Parquet files a location holds, their rows and schema.

Shared by both sides (the operator checks an input exists before it claims a run directory; the
runtime plans columns from the schema), so it imports neither Airflow nor Ray: only pyarrow,
through the stage's filesystem layer, and only from the footers (counting never reads the data).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow_provider_batchinfer.store.stage import Stage


class InputError(ValueError):
    """The input cannot be scored as given; the message names the file or column.

    ``permanent``: a missing or mistyped column, a duplicated or null id, files whose schemas differ
    are in the input's bytes, which a retry reads again, so the task fails without its retries.
    Only :class:`InputReadError` (a store that failed to answer) is left to the retries."""

    permanent = True


class InputReadError(InputError):
    """An input file could not be read because its store failed (not because of its bytes); a retry
    may find the store answering again, so it is not ``permanent``."""

    permanent = False


class CorruptInputError(InputError):
    """An input file is not readable Parquet (truncated, bad magic, unreadable footer or pages). A
    retry reads the same bytes, so it is ``permanent``: the task fails without its retries."""

    permanent = True


class EmptyInputError(InputError):
    """The input holds no rows (an existing directory without Parquet files, or files of 0 rows).
    ``permanent``: a retry finds the same input; ``InputSpec(on_empty=...)`` says what to do instead."""

    permanent = True


# pyarrow reports a store's failures as OSError too: these say the request failed, not the bytes
_NOT_CORRUPTION = re.compile(r"AWS Error|curl|[Cc]onnection|[Tt]imed? ?out|[Tt]hrottl|SlowDown|Unavailable")


def is_corrupt_parquet(exc: BaseException) -> bool:
    """Whether pyarrow's ``exc`` says a file's bytes are not Parquet (``ArrowInvalid``: bad magic,
    a file smaller than a footer; ``OSError``: a footer or page that does not decode), rather than
    that reading them failed (a store's error, which a retry may fix)."""
    import pyarrow as pa

    if isinstance(exc, FileNotFoundError | PermissionError):
        return False
    if isinstance(exc, pa.ArrowInvalid):
        return True
    return isinstance(exc, OSError) and not _NOT_CORRUPTION.search(str(exc))


def corrupt_file(location: str, exc: BaseException) -> CorruptInputError:
    """The error for an input file whose bytes are not readable Parquet."""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return CorruptInputError(
        f"input file {location} is not a readable Parquet file ({detail}): it is truncated or corrupt, and a retry "
        "reads the same bytes. Rewrite it in data_prep, or remove it from the input"
    )


@contextmanager
def reading_parquet(location: str) -> Iterator[None]:
    """Around a read of the Parquet file at ``location``: a corrupt file's error becomes a
    :class:`CorruptInputError` naming it (raised from None: the message carries pyarrow's); any
    other error passes unchanged."""
    try:
        yield
    except Exception as exc:
        if not is_corrupt_parquet(exc):
            raise
        raise corrupt_file(location, exc) from None


def list_input_files(
    locations: list[str], storage_options: dict[str, Any] | None, allow_empty: bool = False
) -> list[str]:
    """Expand files and directories into the Parquet files they hold, as full locations.

    Hidden and underscore-prefixed names (``_SUCCESS``, ``.tmp``) are skipped as Spark and Ray do.
    A location that does not exist is an error; directories that hold no Parquet file are an
    :class:`EmptyInputError`, or ``[]`` with ``allow_empty``.
    """
    files: list[str] = []
    for location in locations:
        stage = Stage.open(location, storage_options)
        if not stage.exists():
            raise InputError(f"input {location} does not exist")
        if not stage.is_dir():
            files.append(location)
            continue
        for rel, _size in stage.list_files():
            if any(part.startswith(("_", ".")) for part in rel.split("/")):
                continue
            if rel.endswith(".parquet") or rel.endswith(".pq"):
                files.append(stage.child(*rel.split("/")).location)
    if not files and not allow_empty:
        raise EmptyInputError(
            f"input {', '.join(locations)} holds no Parquet files; nothing to score. Check data_prep's output, or set "
            'InputSpec(on_empty="skip") or on_empty="commit" when a run legitimately has no rows'
        )
    return files


def inspect_input(
    files: list[str], storage_options: dict[str, Any] | None, allow_empty: bool = False
) -> tuple[int, Any, list[list[int]]]:
    """(total rows, schema, each file's rows per row group) from the Parquet footers only: counting
    never reads the data, and the row groups plan the job's reads (``runtime/inputs/parquet_read.py``).
    A file whose footer does not read as Parquet is a :class:`CorruptInputError` naming it; an
    input of 0 rows an :class:`EmptyInputError`, unless ``allow_empty`` (the schema is then None
    when there are no files)."""
    import pyarrow.parquet as pq

    total = 0
    schema = None
    file_groups: list[list[int]] = []
    for location in files:
        stage = Stage.open(location, storage_options)
        try:
            with reading_parquet(location), stage.fs.open_input_file(stage.path) as f:
                meta = pq.read_metadata(f)
                file_schema = meta.schema.to_arrow_schema()
        except CorruptInputError:
            raise
        except Exception as exc:  # a store's error: pyarrow's message alone would not name the file
            raise InputReadError(f"input file {location} could not be read: {exc}") from exc
        total += meta.num_rows
        file_groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        if schema is None:
            schema = file_schema
        elif not file_schema.equals(schema, check_metadata=False):
            diff = sorted({f"{f.name}: {f.type}" for f in file_schema} ^ {f"{f.name}: {f.type}" for f in schema})
            raise InputError(
                f"input file {location} has a different schema from {files[0]}: {diff}; write every file of "
                "the input with the same columns and types in data_prep"
            )
    if total == 0 and not allow_empty:
        raise EmptyInputError(
            f"input {', '.join(files[:3])}{' …' if len(files) > 3 else ''} holds 0 rows; nothing to "
            'score. Check data_prep\'s output, or set InputSpec(on_empty="skip") or on_empty="commit" when a run '
            "legitimately has no rows"
        )
    return total, schema, file_groups
