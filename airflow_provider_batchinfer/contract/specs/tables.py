"""How tables are named in specs, inputs and XCom, checked when the DAG file is parsed.

- output: ``OutputSpec(table="<namespace>.<table>", mode=SaveMode.ERROR | OVERWRITE)``;
- input: ``input="iceberg://<namespace>.<table>"``, optionally ``?snapshot_id=<id>&row_filter=<expr>``
  (build it with :func:`iceberg_input`, which encodes the filter);
- a committed run: ``iceberg://<namespace>.<table>/<run key>`` (the operator's ``output_location``,
  what the sensor and ``read_committed`` take).

Imports nothing heavy: pyiceberg only to check a row filter's syntax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlencode

from airflow_provider_batchinfer.contract.layout import ContractError
from airflow_provider_batchinfer.contract.tables import TABLE_SCHEME, check_table_identifier


def _templated(value: str) -> bool:
    return "{{" in value or "{%" in value


def check_table_output(table: Any, stage_location: Any, base_stage_location: Any) -> None:
    """``OutputSpec(table=...)``'s locations: a table name (or a template) and no ``stage_location``.
    ValueError naming the field; the spec turns it into its own error (tables sit below specs)."""
    if not isinstance(table, str) or not table:
        raise ValueError(f"OutputSpec.table must be '<namespace>.<table>', got {table!r}.")
    if not _templated(table):
        try:
            check_table_identifier(table, "OutputSpec.table")
        except ContractError as exc:
            raise ValueError(str(exc)) from None
    if stage_location:
        raise ValueError(
            "OutputSpec.table commits into an Iceberg table: drop stage_location (base_stage_location may name "
            "where each run's claim, _job.json, is kept; by default <stage root>/_tables/<table>/)."
        )
    if base_stage_location is not None and not isinstance(base_stage_location, str):
        raise ValueError("OutputSpec.base_stage_location must be a string path or URI.")


@dataclass(frozen=True)
class TableInputRef:
    """A parsed ``iceberg://`` input: the table, and optionally the snapshot and a row filter."""

    identifier: str
    snapshot_id: int | None = None
    row_filter: str | None = None


def is_table_input(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(TABLE_SCHEME)


def check_row_filter(row_filter: str) -> str:
    """A pyiceberg filter expression (``"day = '2026-11-23' and score > 0.5"``), checked by its parser."""
    from pyiceberg.expressions.parser import parse

    try:
        parse(row_filter)
    except Exception as exc:  # pyparsing's ParseException and friends
        raise ContractError(
            f"row_filter {row_filter!r} is not a pyiceberg filter expression ({exc}); write e.g. "
            "\"day = '2026-11-23' and score > 0.5\""
        ) from None
    return row_filter


def parse_table_input(uri: str) -> TableInputRef:
    """``iceberg://ns.table[?snapshot_id=<id>&row_filter=<expr>]`` -> its parts, each checked."""
    if not is_table_input(uri):
        raise ContractError(f"{uri!r} is not an iceberg:// input")
    rest = uri[len(TABLE_SCHEME) :]
    identifier, _, query = rest.partition("?")
    check_table_identifier(identifier.rstrip("/"), "input")
    params = parse_qs(query, keep_blank_values=True, strict_parsing=False) if query else {}
    unknown = sorted(set(params) - {"snapshot_id", "row_filter"})
    if unknown:
        raise ContractError(f"input {uri!r}: unknown parameter(s) {unknown}; use snapshot_id and row_filter")
    snapshot_id = None
    if "snapshot_id" in params:
        text = params["snapshot_id"][-1]
        if not text.lstrip("-").isdigit():
            raise ContractError(f"input {uri!r}: snapshot_id must be a whole number, got {text!r}")
        snapshot_id = int(text)
    row_filter = check_row_filter(params["row_filter"][-1]) if params.get("row_filter") else None
    return TableInputRef(identifier.rstrip("/"), snapshot_id, row_filter)


def iceberg_input(table: str, *, snapshot_id: int | None = None, row_filter: str | None = None) -> str:
    """The ``input=`` for an Iceberg table: ``iceberg_input("lake.tickets", row_filter="day = '2026-11-23'")``.

    Without ``snapshot_id`` the first try of a run pins the table's current snapshot, and every
    retry or re-run of the same run reads that snapshot again."""
    check_table_identifier(table, "table")
    params: dict[str, Any] = {}
    if snapshot_id is not None:
        params["snapshot_id"] = int(snapshot_id)
    if row_filter is not None:
        params["row_filter"] = check_row_filter(row_filter)
    return TABLE_SCHEME + table + (f"?{urlencode(params)}" if params else "")


def check_table_input_argument(value: Any) -> None:
    """The operator's ``input=`` when it is an ``iceberg://`` URI: checked at parse time unless templated."""
    if is_table_input(value) and not _templated(value):
        parse_table_input(value)


def run_location(identifier: str, run_key: str) -> str:
    """``iceberg://<table>/<run key>``: one committed run of a table (the operator's ``output_location``)."""
    return f"{TABLE_SCHEME}{identifier}/{run_key}"


def is_run_location(location: Any) -> bool:
    return isinstance(location, str) and location.startswith(TABLE_SCHEME) and "/" in location[len(TABLE_SCHEME) :]


def parse_run_location(location: str) -> tuple[str, str]:
    """``iceberg://<table>/<run key>`` -> (table, run key)."""
    identifier, _, run_key = location[len(TABLE_SCHEME) :].partition("/")
    check_table_identifier(identifier, "location")
    if not run_key or "/" in run_key:
        raise ContractError(f"{location!r} must look like iceberg://<namespace>.<table>/<run key>")
    return identifier, run_key
