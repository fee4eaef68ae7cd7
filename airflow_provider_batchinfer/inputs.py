"""The input of a job: which Parquet files a location holds, their rows and schema.

Shared by both sides (the operator checks an input exists before it claims a run directory; the
runtime plans columns from the schema), so it imports neither Airflow nor Ray: only pyarrow,
through the stage's filesystem layer, and only from the footers (counting never reads the data).
"""

from __future__ import annotations

from typing import Any

from airflow_provider_batchinfer.stage import Stage


class InputError(ValueError):
    """The input cannot be scored as given; the message names the file or column."""


def list_input_files(locations: list[str], storage_options: dict[str, Any] | None) -> list[str]:
    """Expand files and directories into the Parquet files they hold, as full locations.

    Hidden and underscore-prefixed names (``_SUCCESS``, ``.tmp``) are skipped as Spark and Ray do.
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
    if not files:
        raise InputError(f"input {', '.join(locations)} holds no Parquet files")
    return files


def inspect_input(files: list[str], storage_options: dict[str, Any] | None) -> tuple[int, Any, list[list[int]]]:
    """(total rows, schema, each file's rows per row group) from the Parquet footers only: counting
    never reads the data, and the row groups plan the job's reads (``runtime/parquet_read.py``)."""
    import pyarrow.parquet as pq

    total = 0
    schema = None
    file_groups: list[list[int]] = []
    for location in files:
        stage = Stage.open(location, storage_options)
        try:
            with stage.fs.open_input_file(stage.path) as f:
                meta = pq.read_metadata(f)
                file_schema = meta.schema.to_arrow_schema()
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError with terse messages
            raise InputError(f"input file {location} is not a readable Parquet file: {exc}") from exc
        total += meta.num_rows
        file_groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        if schema is None:
            schema = file_schema
        elif not file_schema.equals(schema, check_metadata=False):
            diff = sorted(set(map(str, file_schema)) ^ set(map(str, schema)))
            raise InputError(f"input file {location} has a different schema from {files[0]}: {diff}")
    if total == 0:
        raise InputError(
            f"input {', '.join(files[:3])}{' …' if len(files) > 3 else ''} holds 0 rows; nothing to "
            "score. Check data_prep's output (a run that legitimately has no rows should skip this task)"
        )
    return total, schema, file_groups
