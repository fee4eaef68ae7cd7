"""The actor pool's Ray Data pipeline: ``read_parquet`` where the work runs, or a small input read here
(``small_input.py``), of the rows left under RESUME; incremental reuse, part boundaries, then the model
replicas (or vLLM's engines). The driver (``driver.py``) wraps it with the provenance columns and
writes it through the parts datasink (``io.py``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from airflow_provider_batchinfer.registry import MODEL_CACHE_ENV
from airflow_provider_batchinfer.runtime.engine.part_rows import cut_into_parts
from airflow_provider_batchinfer.runtime.incremental import scoring as reuse
from airflow_provider_batchinfer.runtime.inputs.small_input import read_small_input
from airflow_provider_batchinfer.runtime.job import CheckedJob
from airflow_provider_batchinfer.runtime.model import llm, usage
from airflow_provider_batchinfer.runtime.output.parts import read_input
from airflow_provider_batchinfer.runtime.planning.pipeline import ActorPool, io_tasks
from airflow_provider_batchinfer.runtime.tuning import TUNING
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    from ray.data import Dataset


#: who read a pool job's input: the runtime's driver, the replicas themselves, or read tasks of their own
ReadBy = Literal["here", "replicas", "tasks"]


class PoolDataset(NamedTuple):
    """The pipeline up to the model, and whether its scored blocks are written here (``io.write_here``):
    an input read in the runtime's driver (``small_input.py``) on a one-node pool."""

    dataset: Dataset
    read_here: bool


def build_dataset(checked: CheckedJob, pool: ActorPool, counter: Any) -> PoolDataset:
    """``read_parquet`` (RESUME: of the rows left, ``resume.py``) -> (``rows_per_part``) -> the model.
    Reads, cuts and writes ask for ``pool["io_cpus"]`` each: they run beside the replicas in the job's
    reservation (``resources.py``)."""
    import ray.data

    job, spec, plan, storage = checked.job, checked.job.job_spec, checked.plan, checked.storage
    input_spec, model = job.input_spec, job.model
    io = {"num_cpus": pool["io_cpus"]}
    replica = replica_remote_args(pool)
    # RESUME: the rest; incremental: copies with each row's key and earlier place (reuse_match.py)
    files, columns = reuse.keyed_input(checked.reuse, checked.read_files, plan["read"])
    fuse, input_bytes = reads_in_replicas(checked, pool), checked.todo_rows * checked.row_bytes
    ds, read_by = _read(files, columns, storage, (io, replica), pool, fuse, input_bytes)
    skip_memory_polls(ds)
    fused = read_by == "replicas"
    ds = reuse.with_keys(ds, checked.reuse, io)  # row keys + where an earlier run has them
    if spec.rows_per_part:  # commit granularity for RESUME: one part per this many rows
        ds = cut_into_parts(ds, spec.rows_per_part, io)  # at the io share, not Ray's 1 CPU (part_rows.py)
    if checked.engine == "vllm":  # ray.data.llm runs its own stages and engine actors
        print(
            f"[batchinfer] engine: vLLM via ray.data.llm, {spec.replicas} engine replica(s) x "
            f"{llm.gpus_per_replica(spec)} GPU(s)",
            flush=True,
        )
        pipeline = llm.build_pipeline(
            ds,
            llm.model_source(checked.registry, model),
            dict(model.signature or {}),
            dict(plan),
            dict(input_spec.params),
            spec,
            counter,
        )
        return PoolDataset(pipeline, read_here=False)
    if fused:
        unthrottle(ds)
    scored = ds.map_batches(
        reuse.replica_class(checked.reuse, storage, base=usage.MeteredReplica),  # + reuse, timed
        fn_constructor_kwargs={
            **replica_kwargs(checked, pool, counter),
            **({"slice_rows": checked.batch_rows} if fused else {}),  # a whole block: cut here (usage.py)
        },
        batch_size=None if fused else checked.batch_rows,  # fused: each read task's block, whole
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(
            min_size=pool["min_replicas"],
            max_size=pool["replicas"],
            # fused: one call reads its block while another scores (the model still runs one call at a
            # time: Ray Data serializes a callable class's calls unless told otherwise)
            max_concurrent_calls_per_actor=2 if fused else None,
        ),
        **replica,
    )
    # on one node the write task would run beside the replicas anyway; over several nodes the job keeps
    # its write tasks, which also leave a replica still loading its model the time to report its node
    one_node = pool["num_workers"] == 1
    return PoolDataset(scored, read_here=read_by == "here" and checked.reuse is None and one_node)


def replica_remote_args(pool: ActorPool) -> dict[str, Any]:
    """What each replica asks Ray for: its CPUs, GPUs and memory (``JobSpec.memory``, or the token
    that keeps each node to its share)."""
    args: dict[str, Any] = {"num_cpus": pool["num_cpus"], "memory": pool["memory"]}
    if pool["num_gpus"]:
        args["num_gpus"] = pool["num_gpus"]
    return args


def reads_in_replicas(checked: CheckedJob, pool: ActorPool) -> bool:
    """Whether the replicas read their own input: a CPU job whose replicas take the read tasks'
    blocks as they come. Ray Data then fuses the read into the replica's actor (it fuses a task
    operator into the actor operator after it when both ask for the same resources and the actor
    takes whole blocks), so the rows go from the Parquet file to the model in one process, without
    a read task's worker, the object store's copy and the executor's scheduling of each block in
    between: on a small machine those took the CPU the model needed. A GPU job keeps its reads
    in CPU tasks beside the replicas, so the GPU never waits for Parquet; incremental reuse and
    ``rows_per_part`` put their own stages between the read and the model."""
    spec = checked.job.job_spec
    return not pool["num_gpus"] and checked.engine != "vllm" and checked.reuse is None and not spec.rows_per_part


def unthrottle(ds: Dataset) -> None:
    """Turn off Ray Data's per-operator budgets for this dataset (its own context: the process's is
    left alone). Inside the job's placement group Ray Data budgets object store memory with the
    group's bundles, which name none, so every operator's budget is zero and each replica gets one
    task at a time: it waited between blocks for the executor to hand it the next one. With the
    reads in the replicas nothing runs ahead of them: each replica runs two calls at once and holds
    at most Ray Data's tasks in flight per actor (small: a file's row groups to read), and the
    write tasks, capped at ``io_tasks``, take the scored blocks as they come."""
    ds.context.op_resource_reservation_enabled = False


def rows_per_write(checked: CheckedJob) -> int | None:
    """Rows one write task gathers into one part (``Tuning.write_task_bytes`` of the model's input
    columns); None, a part per block, where the parts' rows are set upstream (``JobSpec.rows_per_part``,
    RESUME's unit, and incremental scoring's keyed parts) or the input's footers gave no row size."""
    if checked.job.job_spec.rows_per_part or checked.reuse is not None or checked.row_bytes <= 0:
        return None
    return max(1, int(TUNING.write_task_bytes / checked.row_bytes))


def skip_memory_polls(ds: Dataset) -> None:
    """Stop Ray Data polling each map task's memory for this dataset (its own context). It asks
    psutil for the process's unique memory once a second, a walk over every mapping of a replica
    that holds torch and its model, for a figure only its stats show; Ray's memory monitor still
    guards the nodes."""
    ds.context.memory_usage_poll_interval_s = None


def replica_read_bytes(input_bytes: float, replicas: int) -> int:
    """Input bytes per read task when the replicas read their own input: ``Tuning.replica_read_task_bytes``,
    or less for an input that would give fewer than two read tasks per replica (never below
    ``Tuning.read_task_bytes``)."""
    share = int(input_bytes / (2 * max(1, replicas)))
    return max(TUNING.read_task_bytes, min(TUNING.replica_read_task_bytes, share))


def _read(
    files: list[str],
    columns: list[str],
    storage: dict[str, Any] | None,
    remote_args: tuple[dict[str, Any], dict[str, Any]],
    pool: ActorPool,
    fuse: bool,
    input_bytes: float = 0.0,
) -> tuple[Dataset, ReadBy]:
    """A small input as one block read here (``small_input.py``), else ``read_parquet`` on the cluster:
    in read tasks of their own (``remote_args[0]``), or, with ``fuse``, in the replicas (asking for
    ``remote_args[1]``, theirs), as many at once as there are replicas. Also says who read it:
    "here", "replicas" or "tasks" (a small input's one block is split into batches for the replicas)."""
    import ray.data

    small = read_small_input(files, columns, storage)
    if small is not None:
        print(
            f"[batchinfer] input read in the driver: {small.num_rows:,} rows, {small.nbytes / 2**20:.1f} MiB in "
            f"{len(files)} file(s), one block (no listing task, footer reader or read task on the cluster)",
            flush=True,
        )
        return ray.data.from_blocks([small]), "here"  # metadata computed here: from_arrow asks a task for it
    filesystem = Stage.open(files[0], storage).fs if storage else None
    # no more read workers than the replicas can keep up with, footer readers sized to the files
    if fuse:
        task_bytes = replica_read_bytes(input_bytes, pool["replicas"])
        return read_input(files, columns, filesystem, remote_args[1], pool["replicas"], task_bytes), "replicas"
    return read_input(files, columns, filesystem, remote_args[0], concurrency=io_tasks(pool)), "tasks"


def replica_kwargs(checked: CheckedJob, pool: ActorPool, counter: Any) -> dict[str, Any]:
    """The replica's constructor arguments, the same for the actor pool and the driver (``in_driver``)."""
    job, spec, plan = checked.job, checked.job.job_spec, checked.plan
    return {
        "model_uri": job.model.uri,
        "sha256": job.model.sha256,
        "plan": plan,
        "params": job.input_spec.params,
        "device": pool["device"],
        "threads": pool["threads"],
        "counter": counter,
        "max_rows": checked.call_rows,
        "policy": {
            "on_error": spec.on_error,
            "keep_columns": plan["passthrough"],
            "id_column": job.input_spec.id_column,
            "max_value_bytes": spec.max_value_bytes,
        },
        "storage_options": checked.storage,  # no credentials: the workers get those from worker_env()
        "num_gpus": pool["num_gpus"],
        "backend": spec.backend,  # ONNX Runtime (flavors/optimized_text.py, optimized_torchscript.py)
        "min_cosine": spec.backend_min_cosine,
        # the driver's model cache, a fallback for nodes started without their own: an argument, not a
        # runtime_env variable, so a job with nothing else to hand its workers sets no runtime_env
        # (``attach.worker_runtime_env``)
        "driver_cache_dir": os.environ.get(MODEL_CACHE_ENV) or None,
    }
