"""``InputSpec`` (what the model reads) and ``OutputSpec`` (where predictions go)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_provider_batchinfer.contract.specs.common import (
    SaveMode,
    SpecError,
    _check_columns,
    _known_fields,
    _parse_save_mode,
)

#: what ``InputSpec.on_empty`` allows: fail the task, skip it, or commit an empty ``_SUCCESS``
ON_EMPTY = ("fail", "skip", "commit")


@dataclass(frozen=True)
class InputSpec:
    """Which input columns the job reads and how the model sees them.

    ``columns``: the columns to read (``None``: all). ``passthrough_columns``: input columns copied
    unchanged next to the predictions, typically ids (``None``: every read column the model does not
    consume). ``column_mapping``: input column -> model input name, for inputs whose names differ
    from the model's signature. ``params``: flavor parameters passed to the model on every batch
    (``batch_size`` for sentence-transformers, ``normalize_embeddings``; ``temperature``,
    ``top_p``, ``max_tokens``, ``stop``, ``seed`` for text generation).
    ``column_handling``: input column -> how its file locations (local paths or ``s3://`` URIs)
    reach the model: ``"bytes"``, ``"base64"`` or ``"data_url"`` (or ``{"encoding": ...,
    "mime_type": ...}``). Files are read on the Ray side, only under the connection's allowed roots.
    ``id_column``: a column whose values are unique per row; it is checked for duplicates before any
    compute, always written next to the predictions and the dead-lettered rows, and it is what
    ``SaveMode.RESUME`` uses to skip rows an earlier attempt already scored.
    ``on_empty``: what an input without rows (a directory with no Parquet file, or files of 0 rows)
    does: ``"fail"`` (the default; the task fails without retries), ``"skip"`` (the task is skipped)
    or ``"commit"`` (an empty ``_SUCCESS`` of 0 rows is committed, so downstream sensors pass). It
    decides no row, so it is not part of the result identity: a RESUME is not refused over it.
    """

    columns: tuple[str, ...] | None = None
    passthrough_columns: tuple[str, ...] | None = None
    column_mapping: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    column_handling: dict[str, Any] = field(default_factory=dict)
    id_column: str | None = None
    on_empty: str = "fail"

    def __post_init__(self) -> None:
        if self.on_empty not in ON_EMPTY:
            raise SpecError(
                f'InputSpec.on_empty={self.on_empty!r} is not one of {list(ON_EMPTY)}: "fail" fails the task, '
                '"skip" skips it, "commit" commits an empty _SUCCESS of 0 rows'
            )
        object.__setattr__(self, "columns", _check_columns("InputSpec", "columns", self.columns))
        object.__setattr__(
            self, "passthrough_columns", _check_columns("InputSpec", "passthrough_columns", self.passthrough_columns)
        )
        if not isinstance(self.column_mapping, dict):
            raise SpecError("InputSpec.column_mapping must be a dict of {input column: model input name}.")
        object.__setattr__(self, "column_mapping", dict(self.column_mapping))
        if not isinstance(self.params, dict):
            raise SpecError("InputSpec.params must be a dict of model parameters, e.g. {'batch_size': 64}.")
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "column_handling", _check_column_handling(self.column_handling))
        if self.id_column is not None and (not isinstance(self.id_column, str) or not self.id_column):
            raise SpecError(f"InputSpec.id_column must be a column name, got {self.id_column!r}.")
        if self.columns is not None and self.id_column is not None and self.id_column not in self.columns:
            raise SpecError(
                f"InputSpec.id_column {self.id_column!r} is not in InputSpec.columns {list(self.columns)}; add it."
            )
        if self.columns is not None:
            missing = [c for c in (self.passthrough_columns or ()) if c not in self.columns]
            if missing:
                raise SpecError(
                    f"InputSpec.passthrough_columns {missing} are not in InputSpec.columns {list(self.columns)}; "
                    "add them to columns or drop them from passthrough_columns."
                )
            missing = [c for c in self.column_mapping if c not in self.columns]
            if missing:
                raise SpecError(
                    f"InputSpec.column_mapping maps {missing}, which are not in InputSpec.columns "
                    f"{list(self.columns)}; add them to columns."
                )
            missing = [c for c in self.column_handling if c not in self.columns]
            if missing:
                raise SpecError(
                    f"InputSpec.column_handling names {missing}, which are not in InputSpec.columns "
                    f"{list(self.columns)}; add them to columns."
                )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("columns", "passthrough_columns"):
            if d[key] is not None:
                d[key] = list(d[key])
        if d["on_empty"] == "fail":  # the default is left out: job files and job identities stay as they were
            del d["on_empty"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InputSpec:
        return cls(**_known_fields(cls, data))


FILE_ENCODINGS = ("bytes", "base64", "data_url")


def _check_column_handling(value: Any) -> dict[str, dict[str, Any]]:
    """``{column: "data_url"}`` or ``{column: {"encoding": "data_url", "mime_type": "image/png"}}``,
    normalized to the second form so the runtime sees one shape."""
    if not isinstance(value, dict):
        raise SpecError("InputSpec.column_handling must be a dict of {column: encoding}, e.g. {'image_path': 'bytes'}.")
    out: dict[str, dict[str, Any]] = {}
    for column, how in value.items():
        if not isinstance(column, str) or not column:
            raise SpecError(f"InputSpec.column_handling keys must be column names, got {column!r}.")
        rule = {"encoding": how} if isinstance(how, str) else dict(how) if isinstance(how, dict) else None
        if rule is None or set(rule) - {"encoding", "mime_type"} or rule.get("encoding") not in FILE_ENCODINGS:
            raise SpecError(
                f"InputSpec.column_handling[{column!r}]={how!r}: use one of {list(FILE_ENCODINGS)} "
                "or {'encoding': <one of them>, 'mime_type': 'image/png'}."
            )
        if rule.get("mime_type") is not None and (
            not isinstance(rule["mime_type"], str) or "/" not in rule["mime_type"]
        ):
            raise SpecError(
                f"InputSpec.column_handling[{column!r}]: mime_type must look like 'image/png', got {rule['mime_type']!r}."
            )
        out[column] = {"encoding": rule["encoding"], "mime_type": rule.get("mime_type")}
    return out


@dataclass(frozen=True)
class OutputSpec:
    """Where predictions go and what to do with what is already there.

    Give exactly one of ``stage_location`` (the exact run directory, used as is) or
    ``base_stage_location`` (the task writes to ``<base>/<sanitized run_id>/``, so every run,
    backfill and manual trigger lands in its own directory). A relative location is resolved under
    the connection's stage root.

    Or give ``table="<namespace>.<table>"``: the rows are committed into that Iceberg table as one
    snapshot per run (``SaveMode.ERROR`` or ``OVERWRITE`` of this run's rows; see docs/iceberg.md);
    ``base_stage_location`` then optionally names where the run's claim (``_job.json``) lives.
    """

    stage_location: str | None = None
    base_stage_location: str | None = None
    mode: SaveMode = SaveMode.ERROR
    # an Iceberg table "<namespace>.<table>" to commit the predictions into (docs/iceberg.md)
    table: str | None = None

    def _check_table_output(self) -> None:
        """``OutputSpec(table=...)``: a table name (or a template), no ``stage_location``, and a save
        mode that means something for a table (``ERROR`` or ``OVERWRITE``)."""
        from airflow_provider_batchinfer.contract.specs.tables import check_table_output

        try:
            check_table_output(self.table, self.stage_location, self.base_stage_location)
        except ValueError as exc:
            raise SpecError(str(exc)) from None
        if self.mode is SaveMode.RESUME:
            raise SpecError(
                "OutputSpec(table=...) supports SaveMode.ERROR (refuse when the table holds this run's rows) and "
                "SaveMode.OVERWRITE (replace exactly this run's rows); SaveMode.RESUME is for directory outputs."
            )

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _parse_save_mode(self.mode))
        if self.table is not None:
            self._check_table_output()
            return
        given = [n for n in ("stage_location", "base_stage_location") if getattr(self, n)]
        if len(given) != 1:
            raise SpecError(
                "OutputSpec needs exactly one of stage_location (an exact run directory) or "
                "base_stage_location (a parent; each run writes to <base>/<run key>/); "
                f"got {'both' if len(given) == 2 else 'neither'}."
            )
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise SpecError(f"OutputSpec.{name} must be a string path or URI, got {type(value).__name__}.")

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage_location": self.stage_location,
            "base_stage_location": self.base_stage_location,
            "mode": self.mode.value,
            **({"table": self.table} if self.table is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OutputSpec:
        return cls(**_known_fields(cls, data))
