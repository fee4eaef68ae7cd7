"""An input without rows under ``InputSpec(on_empty="commit")``: an empty, valid ``_SUCCESS``.

A daily DAG whose day legitimately has no rows still wants its downstream sensors to pass and its
publish step to see "0 rows", not a failed or hand-skipped task. The job then checks what it can
(the model's hashes, and the columns of a 0-row file against the model's signature, so a wrong
schema still fails) and commits a manifest of no parts and 0 input, output and dead-lettered rows
through the same commit as any job (the claim is held, ``_SUCCESS`` is written last). No engine
runs: there is nothing to read or score, so neither Ray nor the model is started.

A SQL input whose query returns no rows (a daily query over a day without rows) is the same case:
its read (``runtime/inputs/sql_input.py``) leaves no file, so the columns are planned from the spec alone.

``"fail"`` and ``"skip"`` never reach here: the input's checks (or the query's read) raise
``inputs.EmptyInputError`` (permanent), which the operator turns into a failed or a skipped task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.runtime.job import CheckedJob, PipelineRun
from airflow_provider_batchinfer.runtime.model import usage
from airflow_provider_batchinfer.runtime.planning import resources
from airflow_provider_batchinfer.runtime.planning.pipeline import (
    ColumnPlan,
    plan_columns,
    size_actor_pool,
    with_id_column,
)
from airflow_provider_batchinfer.runtime.rows.resume import nothing_kept

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.contract import JobFile
    from airflow_provider_batchinfer.registry import ModelRegistry
    from airflow_provider_batchinfer.store.stage import Stage


def empty_plan(job: JobFile, schema: pa.Schema | None, files: list[str]) -> ColumnPlan:
    """The columns a job without rows would have read and passed through: planned from a 0-row
    file's schema as for any input (a column the model needs and the file lacks still fails), or
    from the spec alone when there is no file at all."""
    spec, signature = job.input_spec, dict(job.model.signature or {})
    if schema is not None and files:
        return with_id_column(plan_columns(schema, signature, spec, files[0]), spec.id_column)
    model_inputs = list(signature.get("inputs", {}))
    sources = [next((src for src, m in spec.column_mapping.items() if m == model), model) for model in model_inputs]
    passthrough = list(spec.passthrough_columns or ())
    plan: ColumnPlan = {
        "read": list(dict.fromkeys([*sources, *passthrough])),
        "model_inputs": model_inputs,
        "sources": sources,
        "passthrough": passthrough,
    }
    return with_id_column(plan, spec.id_column)


def checked_empty(
    job: JobFile,
    run_dir: Stage,
    storage: dict[str, Any] | None,
    registry: ModelRegistry,
    files: list[str],
    schema: pa.Schema | None,
    file_groups: list[list[int]],
) -> CheckedJob:
    """The checked job for an input of 0 rows whose spec says to commit it."""

    where = ", ".join(files[:3]) + (" …" if len(files) > 3 else "") if files else ", ".join(job.input_locations)
    print(
        f'[batchinfer] input: 0 rows in {len(files)} file(s) ({where}); InputSpec(on_empty="commit"): committing '
        "an empty _SUCCESS without starting the model",
        flush=True,
    )
    return CheckedJob(
        job=job,
        run_dir=run_dir,
        storage=storage,
        registry=registry,
        files=files,
        file_groups=file_groups,
        input_rows=0,
        plan=empty_plan(job, schema, files),
        kept=nothing_kept(),
        batch_rows=1,
        engine=None,
        call_rows=1,
    )


def run(checked: CheckedJob) -> PipelineRun:
    """What :func:`driver.run_pipeline` returns, for a job that reads and writes nothing."""
    import time

    from airflow_provider_batchinfer.runtime.output import commit

    spec = checked.job.job_spec
    pool = size_actor_pool(spec, resources.reservation(spec, max(1, spec.num_workers)))  # what the manifest records
    now = time.monotonic()
    return PipelineRun(
        written=commit.Written(parts=(), error_parts=()),
        pool=pool,
        ray_ready_at=now,
        pipeline_s=0.0,
        steady_rows_per_s=None,
        placements=[],
        waited_s=0.0,
        meter=usage.Meter(checked.job, pool, None, 0),
    )
