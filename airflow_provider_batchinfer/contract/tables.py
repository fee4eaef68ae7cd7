"""Iceberg tables in the contract: where a run's predictions are committed, and which snapshot it read.

A run that writes a table still has a run directory (``TableOutput.claim_dir``): it holds the
``_job.json`` claim that fences zombie attempts, and the materialized table input. The rows go into
Parquet data files under the table's location (one directory per attempt), and the commit is one
Iceberg snapshot whose summary carries the run key and the manifest's summary
(:data:`SUMMARY_PREFIX` keys). Catalog properties here never hold secrets: those reach the runtime
through its environment (``PYICEBERG_CATALOG__<NAME>__<KEY>``), like S3 credentials.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from airflow_provider_batchinfer.contract._fields import _get, _opt
from airflow_provider_batchinfer.contract.layout import ContractError

#: the provenance columns every batchinfer table carries (the run key is the table's partition)
RUN_KEY_COLUMN = "batchinfer_run_key"
MODEL_VERSION_COLUMN = "batchinfer_model_version"
#: snapshot summary properties written by a batchinfer commit start with this
SUMMARY_PREFIX = "batchinfer."
#: the run's manifest, written beside its data files before the snapshot that commits them
TABLE_MANIFEST_FILE = "_manifest.json"
TABLE_SCHEME = "iceberg://"
TABLE_MODES = ("error", "overwrite")

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def check_table_identifier(identifier: Any, what: str = "table") -> str:
    """``<namespace>.<table>`` (nested namespaces: ``a.b.table``), letters, digits and ``_``."""
    if not isinstance(identifier, str) or not _IDENTIFIER.match(identifier):
        raise ContractError(
            f"{what}={identifier!r} is not an Iceberg table name; write '<namespace>.<table>' with letters, "
            "digits and '_' (e.g. 'ml.ticket_scores')"
        )
    return identifier


def _catalog(data: Mapping[str, Any], where: str) -> dict[str, str]:
    raw = _get(data, "catalog", dict, where, ContractError)
    return {str(k): str(v) for k, v in raw.items()}


@dataclass(frozen=True)
class TableOutput:
    """The table a run commits into.

    ``catalog``: pyiceberg catalog properties (``name`` included, no secrets). ``run_key``: the value
    of :data:`RUN_KEY_COLUMN` for this run's rows (the sanitized Airflow run id). ``mode``:
    ``error`` (refuse when the table holds rows of the run key) or ``overwrite`` (replace exactly
    those rows). ``claim_dir``: the run directory whose ``_job.json`` fences the commit.
    ``location``: the table's location (planned, when the run creates the table). In a manifest read
    back from the table, ``snapshot_id`` is the snapshot that committed the run."""

    identifier: str
    catalog: Mapping[str, str]
    run_key: str
    mode: str
    claim_dir: str
    location: str
    snapshot_id: int | None = None

    def __post_init__(self) -> None:
        check_table_identifier(self.identifier)
        if self.mode not in TABLE_MODES:
            raise ContractError(f"table output mode must be one of {TABLE_MODES}, got {self.mode!r}")

    def with_snapshot(self, snapshot_id: int) -> TableOutput:
        return replace(self, snapshot_id=snapshot_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "identifier": self.identifier,
            "catalog": dict(self.catalog),
            "run_key": self.run_key,
            "mode": self.mode,
            "claim_dir": self.claim_dir,
            "location": self.location,
            "snapshot_id": self.snapshot_id,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "table") -> TableOutput:
        err = ContractError
        return cls(
            identifier=_get(data, "identifier", str, where, err),
            catalog=_catalog(data, where),
            run_key=_get(data, "run_key", str, where, err),
            mode=_get(data, "mode", str, where, err),
            claim_dir=_get(data, "claim_dir", str, where, err),
            location=_get(data, "location", str, where, err),
            snapshot_id=_opt(data, "snapshot_id", int, where, err),
        )


@dataclass(frozen=True)
class TableInput:
    """The table snapshot a run read: pinned when the first try resolved it, so a retry or a
    re-run of the same run key reads the same rows. ``row_filter``: a pyiceberg filter expression."""

    identifier: str
    catalog: Mapping[str, str] = field(default_factory=dict)
    snapshot_id: int | None = None
    row_filter: str | None = None

    def __post_init__(self) -> None:
        check_table_identifier(self.identifier)

    def to_dict(self) -> dict[str, Any]:
        return {
            "identifier": self.identifier,
            "catalog": dict(self.catalog),
            "snapshot_id": self.snapshot_id,
            "row_filter": self.row_filter,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "table_input") -> TableInput:
        err = ContractError
        return cls(
            identifier=_get(data, "identifier", str, where, err),
            catalog=_catalog(data, where),
            snapshot_id=_opt(data, "snapshot_id", int, where, err),
            row_filter=_opt(data, "row_filter", str, where, err),
        )
