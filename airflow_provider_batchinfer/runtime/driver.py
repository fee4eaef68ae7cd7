"""The driver: read one job file, check everything that can be checked before Ray starts, run the
Ray Data pipeline, and commit the run directory. The order is the commit protocol:

1. check the job file, the model (hashes) and the input (files, columns, types) before Ray starts;
2. read the input (``parquet_read.py``) -> ``map_batches(actor pool)`` -> Parquet parts named after this attempt, each
   with the sha256 of its bytes computed while it was written;
3. reconcile counts (input rows == output + dead-lettered rows), then commit through the storage
   layer: re-read ``_job.json`` to make sure this attempt still owns the run directory (a zombie
   attempt must not commit), check the files, and write ``_SUCCESS`` last.

Everything the job needs is in the job file the operator wrote; nothing here imports Airflow.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from airflow_provider_batchinfer.contract import JobFile, Manifest
from airflow_provider_batchinfer.registry import ModelRegistry, verify_local_copy
from airflow_provider_batchinfer.runtime.attach import cluster_can_grow, init_ray
from airflow_provider_batchinfer.runtime.engine import empty_input, in_driver
from airflow_provider_batchinfer.runtime.engine.pool_dataset import build_dataset, rows_per_write
from airflow_provider_batchinfer.runtime.engine.progress import ProgressLog
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.runtime.incremental import match as reuse_match
from airflow_provider_batchinfer.runtime.incremental import scoring as reuse
from airflow_provider_batchinfer.runtime.incremental.source import plan_reuse
from airflow_provider_batchinfer.runtime.inputs import sql_input, table_input
from airflow_provider_batchinfer.runtime.inputs.parquet_read import corrupt_read_error
from airflow_provider_batchinfer.runtime.job import CheckedJob, PipelineRun
from airflow_provider_batchinfer.runtime.model import llm, usage
from airflow_provider_batchinfer.runtime.model.dereference import dereference_plan
from airflow_provider_batchinfer.runtime.model.flavors import call_rows, flavor, transfer_rows
from airflow_provider_batchinfer.runtime.model.replica import replica_init_error
from airflow_provider_batchinfer.runtime.model.usage_board import job_counter
from airflow_provider_batchinfer.runtime.output import commit, table_commit
from airflow_provider_batchinfer.runtime.output.parts import (
    PartsDatasink,
    make_datasink,
    replicas_per_node,
    row_bytes,
    write_here,
)
from airflow_provider_batchinfer.runtime.planning import resources
from airflow_provider_batchinfer.runtime.planning.pipeline import (
    ActorPool,
    batch_rows_for_input,
    io_tasks,
    plan_columns,
    size_actor_pool,
    with_id_column,
)
from airflow_provider_batchinfer.runtime.rows.resume import REMAINING_DIR, discard_remaining, resume_state
from airflow_provider_batchinfer.runtime.rows.unique_ids import check_input_ids
from airflow_provider_batchinfer.store.inputs import inspect_input, list_input_files
from airflow_provider_batchinfer.store.stage import Stage

log = logging.getLogger("batchinfer.runtime")


def read_job_file(location: str) -> JobFile:
    """The job file (``_job.json``) at ``location``, validated (``ContractError`` names a bad key)."""
    try:
        text = Stage.open(location).read_bytes()
    except FileNotFoundError as exc:
        raise JobError(f"job spec {location} does not exist") from exc
    return JobFile.from_json(text, where=location)


def _check_model(job: JobFile, registry: ModelRegistry) -> tuple[str, ...]:
    """The model's hashes and its flavor's preflight; returns its unhashed imports (python_class.py)."""
    from airflow_provider_batchinfer.runtime.model.flavors.python_class import unhashed_imports

    model = job.model
    if registry.is_local:
        local = registry.local_copy(model.name, model.version)
        manifest = verify_local_copy(local, model.sha256)
    else:  # the actors download and re-hash it on their own nodes; here only what a listing shows
        local, manifest = None, registry.check_listing(model.name, model.version, model.sha256)
    for line in flavor(manifest["flavor"]).preflight(local, manifest):  # untrusted types, pickles
        print(f"[batchinfer] {line}", flush=True)
    return unhashed_imports(manifest)


def check_before_ray(job: JobFile) -> CheckedJob:
    """Everything that can fail before any compute: the model's hashes, the input's files, columns,
    types and ids, the resume state, and the engine."""
    storage = dict(job.storage_options) or None
    run_dir = Stage.open(job.run_dir, storage)
    model, input_spec = job.model, job.input_spec
    print(
        f"[batchinfer] job {job.job_id} attempt {job.attempt}: model {model.name}/{model.version} "
        f"({model.flavor}, sha256 {model.sha256[:12]}…) -> {run_dir.location}",
        flush=True,
    )
    registry = ModelRegistry(job.registry_root, storage)
    unhashed = _check_model(job, registry)
    if job.sql_input is not None:  # a query: read here first (runtime/inputs/sql_input.py)
        locations = sql_input.read_sql_input(job, storage)
    else:  # a table's snapshot is read here first; else the job file's own locations
        locations = table_input.read_table_input(job, storage)
    commit_empty = input_spec.on_empty == "commit"  # else an input without rows is an EmptyInputError
    files = list_input_files(locations, storage, allow_empty=commit_empty)
    input_rows, schema, file_groups = inspect_input(files, storage, allow_empty=commit_empty)
    if input_rows == 0:
        return empty_input.checked_empty(job, run_dir, storage, registry, files, schema, file_groups)
    signature = dict(model.signature or {})
    plan = with_id_column(plan_columns(schema, signature, input_spec, files[0]), input_spec.id_column)
    if flavor(model.flavor).allows_missing:  # trees take null/NaN as missing values
        plan["missing_ok"] = list(plan["model_inputs"])
    id_check_s = check_input_ids(files, input_spec.id_column, storage, input_rows) if input_spec.id_column else None
    kept = resume_state(job, run_dir, files, file_groups, plan["read"])  # RESUME: what is left to read
    read_bytes = row_bytes(files[0], plan["read"], storage)
    gpu = job.job_spec.num_gpus > 0  # the replica's device: plan.size_actor_pool picks "cuda" exactly then
    rows_per_call = call_rows(model.flavor, "cuda" if gpu else "cpu", job.job_spec.max_batch_rows, input_spec.params)
    batch_rows = transfer_rows(model.flavor, rows_per_call, read_bytes, gpu=gpu)
    batch_rows = batch_rows_for_input(batch_rows, rows_per_call, input_rows, len(files))
    plan["dereference"] = dereference_plan(
        input_spec.column_handling,
        plan["sources"],
        plan["model_inputs"],
        model.inputs,
        list(job.file_roots),
        storage,
        job.allowed_url_hosts,  # the only hosts a message's http(s) URL is fetched from
    )
    check_backend(job)
    engine = llm.resolve_engine(model.flavor, job.job_spec, job.llm_engine)
    usage.check_budget(job, model.flavor)  # a budget needs prices (or a text generation model)
    if engine == "vllm":
        llm.check_vllm_job(job.job_spec)  # no vllm or no GPUs asked for: fail before Ray starts
    reuse_plan = plan_reuse(job, plan, schema, engine)  # None unless JobSpec.reuse
    print(
        f"[batchinfer] input: {input_rows:,} rows in {len(files)} file(s); model reads {plan['sources']}, "
        f"passes through {plan['passthrough']}",
        flush=True,
    )
    return CheckedJob(
        job=job,
        run_dir=run_dir,
        storage=storage,
        registry=registry,
        files=files,
        file_groups=file_groups,
        input_rows=input_rows,
        plan=plan,
        kept=kept,
        batch_rows=batch_rows,
        engine=engine,
        call_rows=rows_per_call,
        reuse=reuse_plan,
        id_check_s=id_check_s,
        row_bytes=read_bytes,
        unhashed_imports=unhashed,
    )


def check_backend(job: JobFile) -> None:
    """An optimized backend only for the flavor that has one, refused before Ray starts."""
    from airflow_provider_batchinfer.runtime.model.flavors import is_optimized, refuse_backend

    if (backend := job.job_spec.backend) is not None and is_optimized(backend):
        refuse_backend(backend, job.model.flavor, f"{job.model.name}/{job.model.version}")


def log_pool(pool: ActorPool, checked: CheckedJob) -> None:
    """The pool in the job log, with why it differs from the ask."""
    for note in pool["notes"]:
        print(f"[batchinfer] resources: {note}", flush=True)
    nodes = f" over {pool['num_workers']} nodes" if pool["num_workers"] > 1 else ""
    print(
        f"[batchinfer] actor pool: {pool['min_replicas']}..{pool['replicas']} replica(s){nodes} x "
        f"{pool['num_cpus']:g} CPU / {pool['num_gpus']:g} GPU on {pool['device']}, {pool['threads']} thread(s) each, "
        f"reads and writes at {pool['io_cpus']:g} CPU; reserved {pool['reserved_cpus']:g} CPU / "
        f"{pool['reserved_gpus']:g} GPU; batches of {checked.batch_rows:,} rows, model calls of at most "
        f"{checked.call_rows:,} rows",
        flush=True,
    )


def log_placements(placements: list[dict[str, Any]]) -> None:
    if placements:
        where = ", ".join(f"{p['replicas']} on node {p['node_ip']} ({p['node_id'][:12]})" for p in placements)
        print(f"[batchinfer] replicas ran: {where}", flush=True)


@dataclass(frozen=True)
class _Streamed:
    sink: Any
    pipeline_s: float
    steady_rows_per_s: float | None
    placements: list[dict[str, Any]]
    meter: usage.Meter


def stream(checked: CheckedJob, pool: ActorPool) -> _Streamed:
    """Stream the input through the model into parts, logging progress; where the replicas ran."""
    counter = job_counter(checked.job.job_id)  # progress, latencies, tokens: the job's entry on the cluster's board
    try:
        return _stream_counted(checked, pool, counter)
    finally:
        counter.close()


def _stream_counted(checked: CheckedJob, pool: ActorPool, counter: Any) -> _Streamed:
    import ray

    progress = ProgressLog(
        lambda: ray.get(counter.get.remote(), timeout=10), checked.todo_rows, checked.job.job_spec.progress_interval_s
    )
    ds, read_here = build_dataset(checked, pool, counter)
    where = (checked.run_dir.location, checked.job.attempt, checked.storage)
    passthrough, provenance = checked.plan["passthrough"], table_commit.provenance_of(checked.job)
    sink: PartsDatasink
    if checked.reuse:  # + key files
        sink = reuse.make_keyed_datasink(*where, error_columns=passthrough, provenance=provenance)
    else:  # provenance: the run key and model version of a table's rows
        sink = make_datasink(
            *where, error_columns=passthrough, provenance=provenance, rows_per_write=rows_per_write(checked)
        )
    progress.start()
    t_map = time.monotonic()
    replica_error = None
    meter = usage.Meter(checked.job, pool, counter, checked.todo_rows)  # time held, and the budget
    try:
        with meter.guard(ds):  # Ray Data's execution loop stops the write at max_cost's deadline
            if read_here:  # a small input's few blocks: no write task to start
                write_here(ds, sink)
            else:
                ds.write_datasink(sink, ray_remote_args={"num_cpus": pool["io_cpus"]}, concurrency=io_tasks(pool))
    except Exception as exc:  # a replica that could not start, or a corrupt file, says why in text only
        replica_error = replica_init_error(exc) or corrupt_read_error(exc, checked.read_files)
        if replica_error is None:
            raise
        log.debug("replica failed to start", exc_info=True)
    finally:
        progress.stop()
    if replica_error is not None:  # raised outside the handler: its message, not Ray's wrapper, is reported
        raise replica_error
    meter.check(checked.run_dir.location)  # over budget: fail here, nothing committed
    t_done = time.monotonic()
    placements = replicas_per_node(ray.get(counter.placements.remote(), timeout=30))
    log_placements(placements)
    written = sum(p.rows for p in [*sink.parts, *sink.error_parts])
    steady = progress.steady_rate(t_done, written)
    if steady is None:  # no progress report saw rows: the job was shorter than its progress interval
        try:
            steady = ray.get(counter.reported_rate.remote(), timeout=30)
        except Exception:  # a figure for the manifest: never a reason to fail a job whose rows are written
            log.debug("no steady rate from the counter", exc_info=True)
    return _Streamed(sink, t_done - t_map, steady, placements, meter)


def run_pipeline(checked: CheckedJob) -> PipelineRun:
    """Start Ray, reserve the job's share of the cluster, stream the input through the model into
    parts; the reservation is given back and Ray shut down after, whatever happened."""
    import ray

    if not table_input.attached_to_ray():  # else a table input's read tasks attached already
        init_ray(checked.job)
    ray_ready_at = time.monotonic()
    job, spec = checked.job, checked.job.job_spec
    grows = cluster_can_grow(job, os.environ)  # else a job that never fits fails at once, without waiting
    try:
        if checked.engine == "vllm":  # ray.data.llm reserves its own engines: only wait for the GPUs
            if not grows:
                llm.check_cluster(spec, ray.cluster_resources())
            need = llm.gpus_per_replica(spec)
            resources.wait_for_free({"GPU": float(need)}, f"{need} GPU(s) for one vLLM engine replica", spec)
            pool = size_actor_pool(spec, resources.reservation(spec, spec.replicas))
            log_pool(pool, checked)
            streamed, waited_s = stream(checked, pool), 0.0
        else:
            with resources.reserved(spec, f"batchinfer-{job.job_id}-{job.attempt}", cluster_grows=grows) as held:
                pool = size_actor_pool(spec, held.plan)
                log_pool(pool, checked)
                streamed, waited_s = stream(checked, pool), held.waited_s
    finally:
        ray.shutdown()
    written = commit.Written(
        parts=streamed.sink.parts, error_parts=streamed.sink.error_parts, index=getattr(streamed.sink, "index", ())
    )
    return PipelineRun(
        written=written,
        pool=pool,
        ray_ready_at=ray_ready_at,
        pipeline_s=streamed.pipeline_s,
        steady_rows_per_s=streamed.steady_rows_per_s,
        placements=streamed.placements,
        waited_s=waited_s,
        meter=streamed.meter,
    )


def run(spec_location: str) -> Manifest:
    """Run the job whose job file is at ``spec_location`` and commit it; the committed manifest."""
    started_at = datetime.now(timezone.utc)
    t0 = time.monotonic()
    checked = check_before_ray(read_job_file(spec_location))
    if checked.input_rows == 0:  # InputSpec(on_empty="commit"): nothing to read, score or start
        on_pool_because, pipeline = None, empty_input.run(checked)
    else:
        # incremental: where an earlier run scored each row, before Ray
        remaining = checked.run_dir.child(REMAINING_DIR, checked.job.attempt)
        reuse_match.prepare(
            checked.reuse, remaining, checked.storage, checked.read_files, checked.plan["read"], checked.todo_rows
        )
        on_pool_because = in_driver.why_not(checked)  # None: a small job, scored in this process
        if on_pool_because is None:
            table_input.leave_ray()  # a table input read on Ray that left few rows to score
        pipeline = run_pipeline(checked) if on_pool_because else in_driver.run(checked)
    discard_remaining(checked.run_dir, checked.job.attempt)  # RESUME's copies of partly done files
    processed = pipeline.written.rows + pipeline.written.error_rows
    manifest = commit.build_manifest(
        checked.job,
        run_dir=checked.run_dir,
        input_rows=checked.input_rows,
        input_files=checked.files,
        plan=checked.plan,
        pool=pipeline.pool,
        placements=pipeline.placements,
        waited_s=pipeline.waited_s,
        kept=checked.kept,
        written=pipeline.written,
        started_at=started_at,
        finished_at=datetime.now(timezone.utc),
        timings={
            "total_s": round(time.monotonic() - t0, 3),
            "ray_init_s": round(pipeline.ray_ready_at - t0, 3),  # from the job's start: checks + ray.init (if any)
            "pipeline_s": round(pipeline.pipeline_s, 3),
            "rows_per_s": round(processed / pipeline.pipeline_s, 2) if pipeline.pipeline_s > 0 else None,
            "steady_rows_per_s": pipeline.steady_rows_per_s,
            "id_check_s": checked.id_check_s,
            "resume_s": checked.kept["resume_s"],
            "reuse_s": checked.reuse.state.get("reuse_s") if checked.reuse else None,
        },
        usage=pipeline.meter.usage(time.monotonic() - t0, processed),
        reuse=reuse.section(checked.reuse, checked.run_dir, checked.kept, pipeline.written.index, checked.input_rows),
        in_driver=on_pool_because is None,
        unhashed_imports=checked.unhashed_imports,
    )
    if checked.job.table_output is not None:  # one Iceberg snapshot instead of _SUCCESS
        return table_commit.commit_table(checked.job, checked.run_dir, manifest)
    commit.commit(checked.run_dir, manifest)
    return manifest
