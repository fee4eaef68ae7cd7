"""The end of a job: reconcile the counts, apply the error policy, build the ``Manifest`` and commit
it through the storage layer (``rundir.commit``: hold the claim, check, then ``_SUCCESS`` last, in
one step that fails once a newer attempt claimed the directory: ``fence``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import (
    ERRORS_DIR,
    SUCCESS_MARKER,
    Counts,
    FileEntry,
    JobFile,
    JobRecord,
    Manifest,
    ResumeInfo,
)
from airflow_provider_batchinfer.contract.manifest import NodeReplicas, PoolRecord
from airflow_provider_batchinfer.contract.reuse import ReuseInfo
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.store.commit import rundir

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract.specs import JobSpec
    from airflow_provider_batchinfer.contract.usage import Usage
    from airflow_provider_batchinfer.runtime.planning.pipeline import ActorPool, ColumnPlan
    from airflow_provider_batchinfer.runtime.rows.resume import KeptParts
    from airflow_provider_batchinfer.store.stage import Stage


@dataclass(frozen=True)
class Written:
    """What this attempt's write tasks wrote: parts and dead-letter files, with their checksums."""

    parts: Sequence[FileEntry]
    error_parts: Sequence[FileEntry]
    # incremental scoring: the key file written beside each part (contract.reuse.IndexFile)
    index: Sequence[Any] = ()

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def error_rows(self) -> int:
        return sum(p.rows for p in self.error_parts)


def check_reconciled(
    input_rows: int, output_rows: int, error_rows: int, kept_rows: int, attempt: str, run_dir: Stage
) -> None:
    """Every input row is either written or dead-lettered, exactly once; else nothing is committed."""
    if output_rows + error_rows != input_rows:
        raise JobError(
            f"row counts do not reconcile: {input_rows:,} input rows but {output_rows:,} written + {error_rows:,} "
            f"dead-lettered ({kept_rows:,} kept from earlier attempts); not committing "
            f"(parts of attempt {attempt} stay in {run_dir.location} without a {SUCCESS_MARKER})"
        )


def check_error_fraction(
    error_rows: int, input_rows: int, job: JobSpec, run_dir: Stage, error_names: Sequence[str]
) -> None:
    """Fail (nothing committed) when more rows were dead-lettered than ``max_error_fraction`` allows,
    quoting the first messages (from the first of ``error_names``) so the log says what went wrong."""
    if not error_rows or error_rows <= job.error_fraction_limit * input_rows:
        return
    samples: list[str] = []
    try:
        import pyarrow.parquet as pq

        first = run_dir.child(*error_names[0].split("/"))
        with first.fs.open_input_file(first.path) as f:
            samples = pq.read_table(f, columns=["error"]).column("error").to_pylist()[:3]
    except Exception:  # the samples only decorate the message
        pass
    raise JobError(
        f"{error_rows:,} of {input_rows:,} rows ({100 * error_rows / input_rows:.2f}%) could not be scored, above "
        f"JobSpec.max_error_fraction={job.error_fraction_limit:g}; not committing. First errors: "
        f"{'; '.join(samples) or 'see the _errors/ files'}. The failed rows are in {run_dir.location}/{ERRORS_DIR}/"
    )


def build_manifest(
    job: JobFile,
    *,
    run_dir: Stage,
    input_rows: int,
    input_files: Sequence[str],
    plan: ColumnPlan,
    pool: ActorPool,
    kept: KeptParts,
    written: Written,
    started_at: datetime,
    finished_at: datetime,
    timings: Mapping[str, float | None],
    placements: Sequence[Mapping[str, Any]] = (),
    waited_s: float = 0.0,
    usage: Usage | None = None,
    reuse: ReuseInfo | None = None,
    in_driver: bool = False,
    unhashed_imports: tuple[str, ...] = (),
) -> Manifest:
    """Reconcile the counts, apply the error policy, and describe the run directory as committed
    (with the pool the job ran and ``placements``: replicas per node, ``io.replicas_per_node``)."""
    parts = tuple(sorted([*kept["files"], *written.parts], key=lambda p: p.name))
    error_parts = tuple(sorted([*kept["error_files"], *written.error_parts], key=lambda p: p.name))
    output_rows = kept["rows"] + written.rows
    error_rows = kept["error_rows"] + written.error_rows
    kept_rows = kept["rows"] + kept["error_rows"]
    check_reconciled(input_rows, output_rows, error_rows, kept_rows, job.attempt, run_dir)
    check_error_fraction(error_rows, input_rows, job.job_spec, run_dir, [p.name for p in error_parts])
    return Manifest(
        run_dir=run_dir.location,
        files=parts,
        error_files=error_parts,
        counts=Counts(input_rows=input_rows, output_rows=output_rows, error_rows=error_rows),
        on_error=job.job_spec.on_error,
        max_error_fraction=job.job_spec.error_fraction_limit,
        resume=ResumeInfo(
            resumed=job.resume,
            kept_files=len(kept["files"]) + len(kept["error_files"]),
            kept_rows=kept_rows,
            processed_rows=written.rows + written.error_rows,
            removed_files=tuple(kept["removed"]),
        ),
        passthrough_columns=tuple(plan["passthrough"]),
        output_columns=tuple(job.model.outputs),
        model=job.model.without_signature(),
        input_locations=job.input_locations,
        input_files=tuple(input_files),
        job=JobRecord(
            id=job.job_id,
            attempt=job.attempt,
            launcher=job.launcher,
            replicas=pool["replicas"],
            device=pool["device"],
            pool=pool_record(pool, placements, waited_s, in_driver),
        ),
        airflow=job.airflow,
        started_at=started_at.isoformat(),
        finished_at=finished_at.isoformat(),
        timings=dict(timings),
        usage=usage,
        reuse=reuse,
        unhashed_imports=unhashed_imports,
    )


def pool_record(
    pool: ActorPool, placements: Sequence[Mapping[str, Any]], waited_s: float, in_driver: bool = False
) -> PoolRecord:
    """The manifest's ``job.pool``: the pool's bounds, what it reserved and where its replicas ran."""
    return PoolRecord(
        min_replicas=pool["min_replicas"],
        max_replicas=pool["replicas"],
        num_workers=pool["num_workers"],
        reserved_cpus=pool["reserved_cpus"],
        reserved_gpus=pool["reserved_gpus"],
        waited_s=round(waited_s, 3),
        nodes=tuple(NodeReplicas(str(p["node_id"]), str(p["node_ip"]), int(p["replicas"])) for p in placements),
        in_driver=in_driver,
    )


def commit(run_dir: Stage, manifest: Manifest) -> None:
    """Commit through the storage layer (hold, check, ``_SUCCESS`` last and conditional) and say what
    was committed; ``rundir.FencedError`` when the claim moved, and then nothing was committed."""
    rundir.commit(run_dir, manifest)
    counts = manifest.counts
    if counts.error_rows:
        print(
            f"[batchinfer] dead-lettered {counts.error_rows:,} row(s) into {len(manifest.error_files)} file(s) "
            f"under {run_dir.location}/{ERRORS_DIR}/",
            flush=True,
        )
    print(
        f"[batchinfer] committed {counts.output_rows:,} rows in {len(manifest.files)} part(s) to "
        f"{run_dir.location} ({manifest.timings.get('rows_per_s')} rows/s over the pipeline, "
        f"{manifest.timings.get('total_s')}s total)",
        flush=True,
    )
