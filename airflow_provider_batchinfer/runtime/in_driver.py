"""Small jobs scored in the driver process, without an actor pool.

A job's fixed cost on the embedded Ray is mostly its replica: a fresh Ray worker process that
imports torch (1.5 s alone, 4 s while Ray's read and write workers start beside it on two cores)
and loads the model, plus Ray Data's executor. For a 100-row job that is 7 of its 9 seconds. A job
with at most ``JobSpec.in_driver_max_rows`` rows to score (default 1,000, or
``BATCHINFER_IN_DRIVER_MAX_ROWS``) that runs on the embedded Ray (the driver is then on the same
machine as the only Ray node) is scored here instead: the same :class:`MeteredReplica` the pool
would run, called on the input in batches, and one part written with the same name, checksum and
dead-letter split a Ray write task gives it. The commit protocol after it is unchanged.

Only what the plain path does is taken: CPU models with no Ray-side machinery. GPU jobs (Ray owns the
GPUs), vLLM, incremental reuse, RESUME with kept parts, a budget guard and parts smaller than the
input keep the actor pool. The driver holds no Ray reservation meanwhile: it uses a few CPU seconds
of the Airflow worker's machine, which is where the embedded Ray runs anyway.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import part_name
from airflow_provider_batchinfer.contract.lines import EMBEDDED_RAY_ENV
from airflow_provider_batchinfer.runtime import resources, usage
from airflow_provider_batchinfer.runtime.errors import JobError, split_errors
from airflow_provider_batchinfer.runtime.io import _PartWriter
from airflow_provider_batchinfer.runtime.plan import size_actor_pool
from airflow_provider_batchinfer.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.runtime.driver import CheckedJob

EMBEDDED_ENV = EMBEDDED_RAY_ENV  # set by the local launcher for a driver on the embedded Ray
#: the deployment's default for ``JobSpec.in_driver_max_rows`` (0 turns the in-driver path off)
MAX_ROWS_ENV = "BATCHINFER_IN_DRIVER_MAX_ROWS"
DEFAULT_MAX_ROWS = 1_000


class InDriverSettingError(JobError):
    """``BATCHINFER_IN_DRIVER_MAX_ROWS`` is not a whole number: no retry fixes the environment."""

    permanent = True


def max_rows(spec_value: int | None, environ: Mapping[str, str] = os.environ) -> int:
    """The job's own ``in_driver_max_rows``, else the deployment's, else 1,000."""
    if spec_value is not None:
        return spec_value
    raw = environ.get(MAX_ROWS_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_ROWS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InDriverSettingError(
            f"{MAX_ROWS_ENV}={raw!r} is not a whole number of rows >= 0; write e.g. {MAX_ROWS_ENV}=1000, or 0 to "
            "run every job on the actor pool"
        )
    return value


def why_not(checked: CheckedJob, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this job runs on the actor pool, or None when the driver scores it."""
    spec, rows = checked.job.job_spec, checked.todo_rows
    limit = max_rows(spec.in_driver_max_rows, environ)
    reasons = [
        (environ.get(EMBEDDED_ENV) != "1", "not on the embedded Ray"),
        (not 0 < rows <= limit, f"{rows:,} rows to score, in_driver_max_rows={limit:,}"),
        (spec.num_gpus > 0, "GPU replicas"),
        (checked.engine == "vllm", "the vLLM engine"),
        (checked.reuse is not None, "incremental reuse"),
        (len(checked.kept["ids"]) > 0, "RESUME keeps earlier parts"),
        (spec.max_cost is not None or spec.max_output_tokens_total is not None, "a budget guard"),
        (spec.rows_per_part is not None and spec.rows_per_part < rows, "rows_per_part cuts the input"),
    ]
    return next((why for hit, why in reasons if hit), None)


def _direct(target: Any) -> Any:
    """``target`` answering ``obj.method.remote(...)`` by calling the method: the counter the
    replica reports to, without an actor."""

    class Direct:
        def __getattr__(self, name: str) -> Any:
            return SimpleNamespace(remote=getattr(target, name))

    return Direct()


def read_input(checked: CheckedJob) -> pa.Table:
    """The columns the plan reads, from every input file, in order (what ``read_parquet`` yields)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for location in checked.files:
        stage = Stage.open(location, checked.storage)
        with stage._io("read"):
            tables.append(pq.read_table(stage.path, columns=list(checked.plan["read"]), filesystem=stage.fs))
    return pa.concat_tables(tables, promote_options="default")


def _write(checked: CheckedJob, scored: list[pa.Table]) -> tuple[list[Any], list[Any]]:
    """One part (and one dead-letter file when rows failed), named as Ray's write task 0 names its own."""
    from airflow_provider_batchinfer.runtime import table_commit

    job = checked.job
    name = part_name(0, job.attempt)
    error_name = part_name(0, job.attempt, dead_letter=True)
    run_dir = checked.run_dir
    out = _PartWriter(run_dir.child(name), name)
    errors = _PartWriter(run_dir.child(*error_name.split("/")), error_name)
    with run_dir.child(name)._io("write"):
        try:
            for table in scored:
                good, bad = split_errors(table, checked.plan["passthrough"])
                if good is not None and job.table_output is not None:  # 17: the provenance columns
                    good = table_commit.add_provenance(good, job.table_output.run_key, job.model.version)
                if good is not None:
                    out.write(good)
                if bad is not None:
                    errors.write(bad)
        finally:
            part, error_part = out.close(), errors.close()
    return [part] if part else [], [error_part] if error_part else []


def run(checked: CheckedJob) -> Any:
    """Score the job here and return what :func:`driver.run_pipeline` returns for the pool."""
    from airflow_provider_batchinfer.runtime import commit
    from airflow_provider_batchinfer.runtime.driver import PipelineRun, replica_kwargs

    spec = checked.job.job_spec
    pool = size_actor_pool(spec, resources.reservation(spec, 1))
    print(
        f"[batchinfer] scoring {checked.todo_rows:,} rows in the driver process, no actor pool: at most "
        f"in_driver_max_rows={max_rows(spec.in_driver_max_rows):,} rows on the embedded Ray; {pool['threads']} "
        f"thread(s), model calls of at most {spec.max_batch_rows:,} rows",
        flush=True,
    )
    counter = usage.UsageCounter()
    meter = usage.Meter(checked.job, pool, None, checked.todo_rows)
    started = time.monotonic()
    with meter:
        replica = usage.MeteredReplica(**replica_kwargs(checked, pool, _direct(counter)))
        table = read_input(checked)
        step = max(1, checked.batch_rows)
        scored = [replica(table.slice(start, step)) for start in range(0, table.num_rows, step)]
        parts, error_parts = _write(checked, scored)
    meter.stats = counter.summary()
    pipeline_s = time.monotonic() - started
    placements = [{"node_id": "driver", "node_ip": "127.0.0.1", "replicas": 1}]
    return PipelineRun(
        written=commit.Written(parts=parts, error_parts=error_parts),
        pool=pool,
        ray_ready_at=started,
        pipeline_s=pipeline_s,
        steady_rows_per_s=None,
        placements=placements,
        waited_s=0.0,
        meter=meter,
    )
