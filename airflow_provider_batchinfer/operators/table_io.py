"""The operator's Iceberg steps, called with a line each from ``batch_inference.py``.

For ``OutputSpec(table=...)`` the run still has a run directory, the *claim directory*
(``<base_stage_location or <stage root>/_tables/<table>>/<run key>``): it holds ``_job.json``, which
fences zombie attempts, and the job's copy of a table input. The rows go into the table: the job file's
``run_dir`` is this attempt's data directory under the table's location, and the runtime commits
them as one snapshot (``runtime/output/table_commit.py``). ``SaveMode.ERROR`` is checked against the table
here, before anything is written.

For ``input="iceberg://..."`` the snapshot is pinned (the one given; else the one an earlier try of
the same run pinned, read from the claim it left; else the current one) and recorded in the job
file. The worker reads no rows of it: the job reads the pinned snapshot itself, on the Ray side,
into the claim directory's ``_input/`` (``runtime/inputs/table_input.py``).
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_batchinfer.contract import ContractError, JobFile
from airflow_provider_batchinfer.contract.specs import SaveMode
from airflow_provider_batchinfer.contract.specs.tables import is_table_input, parse_table_input, run_location
from airflow_provider_batchinfer.contract.tables import RUN_KEY_COLUMN, TableInput, TableOutput
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.iceberg.catalog import CatalogError, open_catalog, public_catalog
from airflow_provider_batchinfer.store.iceberg.read import load_table, pin_input, run_files
from airflow_provider_batchinfer.store.locations import join, sanitize_run_key
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.launchers.base import TaskLog


def _fail(exc: Exception) -> AirflowException:
    permanent = getattr(exc, "permanent", True)
    return (AirflowFailException if permanent else AirflowException)(str(exc))


def run_key(ti: Any) -> str:
    """The value of the run-key column: the sanitized run id (``-map-<i>`` for a mapped task)."""
    key = sanitize_run_key(ti.run_id)
    map_index = getattr(ti, "map_index", -1)
    return f"{key}-map-{map_index}" if map_index is not None and map_index >= 0 else key


@dataclasses.dataclass(frozen=True)
class TableSteps:
    """One task's table side: its output ``table`` (or None), save mode and input, read through the
    connection's ``hook``. Built from the operator's rendered fields at run time."""

    hook: ModelServiceHook
    table: str | None
    save_mode: SaveMode
    input: str | list[str] | None
    base_stage_location: str | None = None

    def claim_directory(self, ti: Any) -> str:
        """The run's claim directory: ``<base_stage_location>/<run key>``, by default under
        ``<stage root>/_tables/<table>/``."""
        base = self.base_stage_location or f"_tables/{self.table}"
        return join(self.hook.resolve_location(base), run_key(ti))

    def claim_mode(self, run_dir: Stage) -> SaveMode:
        """The save mode for ``rundir.prepare``: a table's claim directory holds only bookkeeping, so
        it is cleared (OVERWRITE); ``SaveMode.ERROR`` is checked against the table itself, before
        anything is written."""
        if not self.table:
            return self.save_mode
        if self.save_mode is SaveMode.ERROR:
            key = posixpath.basename(run_dir.location.rstrip("/"))
            try:
                table = load_table(open_catalog(self.hook.catalog_properties(), self.hook.storage_options), self.table)
                rows = sum(f.record_count for f in run_files(table, key)) if table is not None else 0
            except CatalogError as exc:
                raise _fail(exc) from exc
            if rows:
                raise AirflowFailException(
                    f"Iceberg table {self.table} already holds {rows:,} row(s) of run key {key} ({RUN_KEY_COLUMN}) "
                    "and the save mode is SaveMode.ERROR; nothing was written. Use OutputSpec(table=..., "
                    "mode=SaveMode.OVERWRITE) to replace exactly this run's rows"
                )
        return SaveMode.OVERWRITE

    def pinned_input(self, run_dir: Stage) -> TableInput | None:
        """The snapshot an earlier try of this run pinned (from the claim it left), before it is cleared."""
        if not is_table_input(self.input):
            return None
        try:
            claim = rundir.read_claim(run_dir)
        except ContractError:
            return None
        return None if claim is None else claim.table_input

    def bind(self, job: JobFile, run_dir: Stage, pinned: TableInput | None) -> JobFile:
        """The job file with its table sections: the pinned input snapshot, and for a table output
        the target and this attempt's data directory as ``run_dir``."""
        if not self.table and not is_table_input(self.input):
            return job
        props = self.hook.catalog_properties()
        public = public_catalog(props)
        changes: dict[str, Any] = {}
        try:
            catalog = open_catalog(props, self.hook.storage_options)
            if is_table_input(self.input):
                ref = parse_table_input(str(self.input))
                wanted = TableInput(ref.identifier, public, ref.snapshot_id, ref.row_filter)
                changes["table_input"] = pin_input(catalog, wanted, pinned)
            if self.table:
                changes.update(self._output(catalog, public, run_dir, job.attempt))
        except (CatalogError, ContractError) as exc:
            raise _fail(exc) from exc
        return dataclasses.replace(job, **changes)

    def _output(self, catalog: Any, public: dict[str, str], run_dir: Stage, attempt: str) -> dict:
        from airflow_provider_batchinfer.store.iceberg.catalog import planned_location

        table = load_table(catalog, str(self.table))
        location = table.location() if table is not None else planned_location(public, str(self.table))
        key = posixpath.basename(run_dir.location.rstrip("/"))
        # files of an attempt go under the table (or, for a catalog that picks locations itself and
        # a table it has not created yet, beside the claims); never into the claim directory, which
        # a retry clears
        data_root = join(location, "data") if location else join(posixpath.dirname(run_dir.location), "_data")
        mode = "overwrite" if self.save_mode is SaveMode.OVERWRITE else "error"
        target = TableOutput(str(self.table), public, key, mode, run_dir.location, location or "")
        return {"table_output": target, "run_dir": join(data_root, f"{RUN_KEY_COLUMN}={key}", attempt)}

    @staticmethod
    def log_input(job: JobFile, log: TaskLog) -> None:
        """The pinned snapshot in the task log; its rows are read by the job, not here."""
        ref = job.table_input
        if ref is not None:
            log.info(
                "Input: Iceberg table %s at snapshot %s%s (the job reads it)",
                ref.identifier,
                ref.snapshot_id,
                f" where {ref.row_filter}" if ref.row_filter else "",
            )

    def result_source(self, location: str) -> tuple[str, dict[str, Any]]:
        """Where the task's result is read from: the run directory, or ``iceberg://<table>/<run key>``."""
        if not self.table:
            return location, self.hook.storage_options
        key = posixpath.basename(location.rstrip("/"))
        return run_location(str(self.table), key), self.hook.table_read_options()
