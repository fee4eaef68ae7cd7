"""The table commit's fence: a snapshot commits only while the run's claim is this attempt's.

The claim lives in the claim directory and the snapshot in the catalog, so no single atomic step
covers both. Instead every commit request pyiceberg sends, its own retries included, is preceded
by a check (the ``guard``): the claim still this attempt's, and the run key's files in the table
the very ones the snapshot was planned against. The catalog's commit is optimistic (it applies
only on top of the metadata it was built from), so an attempt that stopped after the check and
resumes after a newer attempt committed finds its request refused, and the retry's check then
fences it off. One that resumes after a newer attempt claimed but before it committed lands its
snapshot; the claim is checked once more after the commit and such a snapshot is rolled back (only
while it is still the table's current one; :func:`roll_back`).

Imported only when a run writes a table (pyiceberg is an optional dependency).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table

from airflow_provider_batchinfer.store.commit.fence import pause_for_test
from airflow_provider_batchinfer.store.iceberg.read import run_files


class RunKeyMoved(Exception):
    """The run key's files changed since the snapshot was planned: plan it again."""


class FencedTable(Table):
    """``table`` with ``guard`` run before each commit request (pyiceberg's retries call
    ``_do_commit`` again after refreshing this table, so the guard sees the table as it is)."""

    def __init__(self, table: Table, guard: Callable[[Table], None]) -> None:
        super().__init__(table.name(), table.metadata, table.metadata_location, table.io, table.catalog, table.config)
        self._guard = guard

    def _do_commit(self, updates: tuple[Any, ...], requirements: tuple[Any, ...]) -> None:
        self._guard(self)
        pause_for_test("table:checked")
        super()._do_commit(updates, requirements)


def guard(ensure_claim: Callable[[], None], run_key: str, planned: list[Any]) -> Callable[[Table], None]:
    """The check before each request: the claim (``ensure_claim`` raises FencedError) and the run
    key's files as planned (RunKeyMoved otherwise: a save mode decided on another table state)."""
    expected = sorted(f.file_path for f in planned)

    def check(table: Table) -> None:
        ensure_claim()
        now = sorted(f.file_path for f in run_files(table, run_key))
        if now != expected:
            raise RunKeyMoved(f"run key {run_key} changed in the table since the commit was planned")

    return check


def roll_back(table: Table, snapshot_id: int) -> bool:
    """Make the parent of ``snapshot_id`` the current snapshot again, only while ``snapshot_id`` is
    still current (the catalog checks that in the same commit). Whether it was rolled back: not
    when another commit came after it, or when it has no parent."""
    table.refresh()
    current = table.current_snapshot()
    if current is None or current.snapshot_id != snapshot_id or current.parent_snapshot_id is None:
        return False
    try:
        table.manage_snapshots().rollback_to_snapshot(current.parent_snapshot_id).commit()
    except CommitFailedException:
        return False
    return True
