"""What every spec shares: the error type, save modes, column-list and field checks."""

from __future__ import annotations

import enum
from dataclasses import fields
from typing import Any


class SpecError(ValueError):
    """A spec that cannot work; the message says what to change."""


class SaveMode(str, enum.Enum):
    """What to do when the run directory already holds files.

    ``ERROR`` (the default) refuses to touch a non-empty run directory, checked before any work.
    ``OVERWRITE`` removes the old ``_SUCCESS`` first and then the rest, so a stale marker never
    sits beside new partial files: this is how retries and backfill re-runs work.
    ``RESUME`` keeps the complete parts that earlier attempts of the *same* run (same task, run,
    model sha256 and input) wrote, and scores only the rows whose ids they do not hold; it needs
    ``InputSpec.id_column``. Anything else in the directory is treated as with ``OVERWRITE``.
    """

    ERROR = "error"
    OVERWRITE = "overwrite"
    RESUME = "resume"


def _parse_save_mode(value: SaveMode | str) -> SaveMode:
    if isinstance(value, SaveMode):
        return value
    try:
        return SaveMode(str(value).lower())
    except ValueError:
        allowed = ", ".join(f"SaveMode.{m.name}" for m in SaveMode)
        raise SpecError(f"OutputSpec.mode={value!r} is not a save mode; use one of {allowed}.") from None


def _check_columns(owner: str, name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise SpecError(f"{owner}.{name} must be a list of column names, not the string {value!r}; write [{value!r}].")
    cols = tuple(value)
    for col in cols:
        if not isinstance(col, str) or not col:
            raise SpecError(f"{owner}.{name} must hold non-empty column names; got {col!r}.")
    dupes = sorted({c for c in cols if cols.count(c) > 1})
    if dupes:
        raise SpecError(f"{owner}.{name} names {dupes} more than once; list each column once.")
    return cols


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SpecError(f"{cls.__name__} has no field(s) {unknown}; known fields: {sorted(names)}.")
    return dict(data)
