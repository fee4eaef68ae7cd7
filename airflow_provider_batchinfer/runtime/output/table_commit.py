"""Committing a run into an Iceberg table: one snapshot per run, after everything else held.

The Ray workers write the predictions as Parquet data files into this attempt's own directory under
the table's location (``<table>/data/batchinfer_run_key=<run key>/<attempt>/``; the job file's
``run_dir``), through the same parts writer as directory outputs, with the provenance columns
(:data:`RUN_KEY_COLUMN`, :data:`MODEL_VERSION_COLUMN`) added on the way. Then, on the driver:

1. the counts reconcile and every file is checked (``commit.build_manifest``, ``validate_manifest``);
2. the manifest is written beside the files (``_manifest.json``: what the snapshot will point at);
3. the table is created on first use (schema of the parts, partitioned by the run key);
4. the save mode is checked against the table as it is now (``error``: no rows of this run key;
   ``overwrite``: this run key's files are replaced), and ONE snapshot is committed, carrying the
   run key and the manifest's summary in its properties. Every commit request, pyiceberg's own
   retries included, first checks that the attempt still holds its claim (``_job.json`` in the
   run's claim directory) and that the run key's files are the ones planned against
   (``table_fence``); the catalog applies a request only on top of the metadata it was built from.
   A concurrent commit of another run makes pyiceberg refresh and retry (fast appends do not
   conflict); a change to this run key's own files starts the check over; a lost claim fails the
   commit, and a snapshot that landed although the claim moved is rolled back.

Nothing is visible to readers before step 4's commit: a killed or failed run leaves only
unreferenced files under its attempt directory (delete them with the table's orphan-file clean-up).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import Manifest
from airflow_provider_batchinfer.contract.tables import (
    MODEL_VERSION_COLUMN,
    RUN_KEY_COLUMN,
    SUMMARY_PREFIX,
    TABLE_MANIFEST_FILE,
    TableOutput,
)
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.iceberg.catalog import CatalogError, open_catalog
from airflow_provider_batchinfer.store.iceberg.read import load_table, run_files
from airflow_provider_batchinfer.store.locations import StageError, join
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

    from airflow_provider_batchinfer.contract import JobFile
    from airflow_provider_batchinfer.store.commit.fence import Hold

_CONFLICT_TRIES = 5


class TableCommitError(StageError):
    """The table refused the run (save mode, schema); ``permanent``: no retry can help."""

    def __init__(self, message: str, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


def add_provenance(batch: pa.Table, run_key: str, model_version: str) -> pa.Table:
    """The run key and model version on every row (both engines' writers, ``io.finish_rows``)."""
    import pyarrow as pa

    for name, value in ((RUN_KEY_COLUMN, run_key), (MODEL_VERSION_COLUMN, model_version)):
        column = pa.array([value] * batch.num_rows, pa.string())
        if name in batch.column_names:
            batch = batch.set_column(batch.column_names.index(name), name, column)
        else:
            batch = batch.append_column(name, column)
    # no field ids from an Iceberg input on the way out: the table maps the parts' columns by name
    return pa.Table.from_arrays(batch.columns, schema=pa.schema([f.remove_metadata() for f in batch.schema]))


def provenance_of(job: JobFile) -> tuple[str, str] | None:
    """(run key, model version) for the parts of a job that writes a table; None otherwise."""
    return None if job.table_output is None else (job.table_output.run_key, job.model.version)


def summary_properties(manifest: Manifest, target: TableOutput, manifest_location: str) -> dict[str, str]:
    """The snapshot summary: the run key, the run's identity and the manifest's summary."""
    p = SUMMARY_PREFIX
    props = {
        p + "run-key": target.run_key,
        p + "attempt": manifest.job.attempt,
        p + "job-id": manifest.job.id,
        p + "mode": target.mode,
        p + "model.name": manifest.model.name,
        p + "model.version": manifest.model.version,
        p + "model.sha256": manifest.model.sha256,
        p + "input-rows": str(manifest.counts.input_rows),
        p + "output-rows": str(manifest.counts.output_rows),
        p + "error-rows": str(manifest.counts.error_rows),
        p + "manifest": manifest_location,
    }
    if manifest.airflow is not None:
        props.update(
            {
                p + "run-id": manifest.airflow.run_id,
                p + "dag-id": manifest.airflow.dag_id,
                p + "task-id": manifest.airflow.task_id,
                p + "try-number": str(manifest.airflow.try_number),
            }
        )
    if manifest.table_input is not None and manifest.table_input.snapshot_id is not None:
        props[p + "input.table"] = manifest.table_input.identifier
        props[p + "input.snapshot-id"] = str(manifest.table_input.snapshot_id)
    return props


def ensure_table(catalog: Catalog, target: TableOutput, schema: pa.Schema) -> Table:
    """The table, created on first use from the parts' schema, partitioned by the run key (so
    OVERWRITE of one run replaces whole files and ERROR's check reads only that partition)."""
    from pyiceberg.exceptions import CommitFailedException, NamespaceAlreadyExistsError, TableAlreadyExistsError

    table = load_table(catalog, target.identifier)
    if table is not None:
        return table
    namespace = target.identifier.rpartition(".")[0]
    try:
        catalog.create_namespace(namespace)
    except NamespaceAlreadyExistsError:
        pass
    kwargs: dict[str, Any] = {"schema": schema}
    if target.location:
        kwargs["location"] = target.location
    try:
        tx = catalog.create_table_transaction(target.identifier, **kwargs)
        with tx.update_spec() as spec:
            spec.add_identity(RUN_KEY_COLUMN)
        # the parts carry no Iceberg field ids: readers map their columns by name
        tx.set_properties({"schema.name-mapping.default": tx.table_metadata.schema().name_mapping.model_dump_json()})
        tx.commit_transaction()
        print(f"[batchinfer] created Iceberg table {target.identifier} at {kwargs.get('location', '')}", flush=True)
    except TableAlreadyExistsError:  # another run created it meanwhile
        pass
    except CommitFailedException:
        # the same race, caught at the commit: a create asserts the table is new ("Table already
        # exists"); any other failed commit leaves no table behind and is re-raised
        if load_table(catalog, target.identifier) is None:
            raise
    except (ValueError, TypeError) as exc:
        raise TableCommitError(
            f"cannot create Iceberg table {target.identifier} from the output schema: {exc}"
        ) from exc
    table = load_table(catalog, target.identifier)
    if table is None:
        raise TableCommitError(f"Iceberg table {target.identifier} vanished right after it was created", False)
    return table


def _commit_once(
    table: Table, target: TableOutput, paths: list[str], props: dict[str, str], ensure_claim: Callable[[], None]
) -> int:
    """One try: the save mode against the table as it is now, then one snapshot, each request
    guarded by ``ensure_claim`` and the run key's planned files (``table_fence``). Its id."""
    from pyiceberg.table import _parquet_files_to_data_files

    from airflow_provider_batchinfer.runtime.output import table_fence

    table.refresh()
    existing = run_files(table, target.run_key)
    if existing and target.mode == "error":
        rows = sum(f.record_count for f in existing)
        raise TableCommitError(
            f"Iceberg table {target.identifier} already holds {rows:,} row(s) of run key {target.run_key} and the "
            "save mode is SaveMode.ERROR; nothing was committed. Use OutputSpec(mode=SaveMode.OVERWRITE) to replace them"
        )
    tx = table_fence.FencedTable(table, table_fence.guard(ensure_claim, target.run_key, existing)).transaction()
    try:
        data_files = list(_parquet_files_to_data_files(tx.table_metadata, paths, table.io))
    except ValueError as exc:  # the parts do not fit the table's schema
        raise TableCommitError(
            f"the predictions do not fit Iceberg table {target.identifier}'s schema: {exc}; nothing was committed. "
            "Write to a new table, or evolve this one's schema first"
        ) from exc
    update = tx.update_snapshot(snapshot_properties=props)
    producer: Any = update.overwrite() if existing else update.fast_append()
    with producer:
        for data_file in existing:
            producer.delete_data_file(data_file)
        for data_file in data_files:
            producer.append_data_file(data_file)
    tx.commit_transaction()
    return int(producer.snapshot_id)


def commit_table(job: JobFile, run_dir: Stage, manifest: Manifest) -> Manifest:
    """Commit the run's files as one snapshot; the manifest with the snapshot's id."""
    from pyiceberg.exceptions import CommitFailedException, ValidationException

    from airflow_provider_batchinfer.runtime.output.table_fence import RunKeyMoved
    from airflow_provider_batchinfer.store.commit.markers import validate_manifest

    target = job.table_output
    if target is None:
        raise JobError("commit_table needs a job with a table output")
    storage = dict(job.storage_options) or None
    manifest = dataclasses.replace(manifest, table=target, table_input=job.table_input)
    Manifest.from_dict(manifest.to_dict(), run_dir.location)  # one schema: what readers accept
    validate_manifest(run_dir, manifest)
    marker = run_dir.child(TABLE_MANIFEST_FILE)
    marker.write_bytes(manifest.to_json().encode("utf-8"))
    paths = [join(run_dir.location, f.name) for f in manifest.files]
    claim_dir = Stage.open(target.claim_dir, storage)
    held = rundir.hold(claim_dir, manifest.job.attempt)
    props = summary_properties(manifest, target, marker.location)
    try:
        catalog = open_catalog(target.catalog, storage)
        table = ensure_table(catalog, target, _parts_schema(run_dir, manifest))
        for tries in range(1, _CONFLICT_TRIES + 1):
            try:
                snapshot_id = _commit_once(table, target, paths, props, lambda: rundir.ensure_held(claim_dir, held))
                break
            except (CommitFailedException, ValidationException, RunKeyMoved) as exc:
                if tries == _CONFLICT_TRIES:
                    raise TableCommitError(
                        f"could not commit into {target.identifier} after {tries} tries: {exc}", False
                    ) from exc
                print(f"[batchinfer] table commit conflict ({exc}); checking again", flush=True)
                time.sleep(0.2 * tries)
    except CatalogError as exc:
        raise TableCommitError(str(exc), exc.permanent) from exc
    _check_still_held(table, claim_dir, held, snapshot_id)
    c = manifest.counts
    print(
        f"[batchinfer] committed {c.output_rows:,} rows in {len(manifest.files)} file(s) to Iceberg table "
        f"{target.identifier} as snapshot {snapshot_id} (run key {target.run_key}, {target.mode})",
        flush=True,
    )
    return dataclasses.replace(manifest, table=target.with_snapshot(snapshot_id))


def _check_still_held(table: Table, claim_dir: Stage, held: Hold, snapshot_id: int) -> None:
    """The claim once more after the commit: unchanged since before it, the snapshot was committed
    while this attempt held it. Changed, it may not have been: roll it back and fail."""
    from airflow_provider_batchinfer.runtime.output.table_fence import roll_back

    try:
        rundir.ensure_held(claim_dir, held)
    except rundir.FencedError as exc:
        undone = roll_back(table, snapshot_id)
        outcome = (
            "it was rolled back"
            if undone
            else "it stays: other commits came after it (a newer attempt's OVERWRITE replaces its rows)"
        )
        raise rundir.FencedError(f"{exc}; its snapshot {snapshot_id} landed as the claim moved, and {outcome}") from exc


def _parts_schema(run_dir: Stage, manifest: Manifest) -> pa.Schema:
    """The Arrow schema of the first part (every part has it), for creating the table."""
    import pyarrow.parquet as pq

    if not manifest.files:
        raise TableCommitError("the run wrote no rows, so there is no schema to create the table with", True)
    first = run_dir.child(*manifest.files[0].name.split("/"))
    with first.fs.open_input_file(first.path) as f:
        return pq.read_schema(f)
