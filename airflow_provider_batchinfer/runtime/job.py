"""The Ray-side entrypoint: read one job spec, score every row, commit the run directory.

Everything the job needs is in the spec file the operator wrote (``_job.json``); this module never
imports Airflow, so the same entrypoint runs as a subprocess of an Airflow task (``local``) or as
a Ray Jobs API entrypoint on a cluster. The order is the commit protocol:

1. check the spec, the model (hashes) and the input (files, columns, types) before Ray starts;
2. ``read_parquet`` -> ``map_batches(actor pool)`` -> Parquet parts named after this attempt;
3. reconcile counts (input rows == output rows), re-read ``_job.json`` to make sure this attempt
   still owns the run directory (a zombie attempt must not commit), then write ``_SUCCESS`` last.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

from airflow_provider_batchinfer.registry import MODEL_CACHE_ENV, ModelRegistry, fetch_version, verify_local_copy
from airflow_provider_batchinfer.runtime.errors import check_batch, check_unique_ids, score_isolating
from airflow_provider_batchinfer.runtime.io import (
    InputError,
    ProgressCounter,
    inspect_input,
    list_input_files,
    make_datasink,
    row_bytes,
)
from airflow_provider_batchinfer.s3 import worker_env
from airflow_provider_batchinfer.runtime import llm
from airflow_provider_batchinfer.runtime.dereference import dereference_inputs, dereference_plan
from airflow_provider_batchinfer.runtime.flavors import transfer_rows
from airflow_provider_batchinfer.specs import InputSpec, JobSpec
from airflow_provider_batchinfer.stage import (
    JOB_SPEC_FILE,
    MANIFEST_FORMAT,
    SUCCESS_MARKER,
    Stage,
    StageError,
    validate_manifest,
)

log = logging.getLogger("batchinfer.runtime")
JOB_FORMAT = "batchinfer.job/1"
RESULT_PREFIX = "BATCHINFER_RESULT "
ERROR_PREFIX = "BATCHINFER_ERROR "


class JobError(RuntimeError):
    """The job cannot finish; nothing is committed. The message says why."""


class FencedError(JobError):
    """Another attempt took over the run directory; this one must not commit."""


# --- column planning (pure, tested without Ray) ----------------------------------------------------

_KINDS = {
    "string": ("string", "large_string"),
    "int": ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
    "float": ("float", "double", "halffloat", "float32", "float64", "float16"),
}


def _arrow_kind(arrow_type: Any) -> str:
    import pyarrow as pa

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type):
        return "float"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        return "list"
    if pa.types.is_boolean(arrow_type):
        return "bool"
    return str(arrow_type)


def _accepts(signature_dtype: str, arrow_type: Any) -> bool:
    kind = _arrow_kind(arrow_type)
    want = signature_dtype.lower()
    if want in ("any", ""):
        return True
    if want.startswith("list") or want.endswith("]"):
        return kind == "list"
    if want in ("string", "str", "text"):
        return kind == "string"
    if want.startswith(("float", "double", "int", "uint", "number")):
        return kind in ("int", "float", "bool")
    if want == "bool":
        return kind in ("bool", "int")
    return True


def plan_columns(schema: Any, signature: dict[str, Any], input_spec: InputSpec, first_file: str) -> dict[str, Any]:
    """Decide what to read, what the model gets and what passes through, failing with the column's
    name before any compute when the input cannot match the model's signature."""
    available = list(schema.names)
    # an "optional" input (a text model's per-row sampling_params) is read only when the input has it
    model_inputs = [m for m, dtype in signature.get("inputs", {}).items()
                    if str(dtype).lower() != "optional" or m in available or m in input_spec.column_mapping.values()]
    source_of = {model: model for model in model_inputs}
    for src, model in input_spec.column_mapping.items():
        if model not in source_of:
            raise InputError(
                f"InputSpec.column_mapping maps {src!r} to {model!r}, but the model's inputs are {model_inputs}"
            )
        source_of[model] = src
    if input_spec.columns is not None:
        unknown = [c for c in input_spec.columns if c not in available]
        if unknown:
            raise InputError(f"InputSpec.columns {unknown} are not in the input {first_file} (columns: {available})")
    for model, src in source_of.items():
        if src not in available:
            hint = f"; map another column to it with InputSpec.column_mapping={{'<column>': {model!r}}}" if src == model else ""
            raise InputError(
                f"model input {model!r} needs column {src!r}, which the input {first_file} does not have "
                f"(columns: {available}){hint}"
            )
        arrow_type = schema.field(src).type
        want = signature["inputs"][model]
        if not _accepts(want, arrow_type):
            raise InputError(
                f"column {src!r} of {first_file} is {arrow_type}, but model input {model!r} expects {want}; "
                "cast it in data_prep or log the model with a matching signature"
            )
    read = list(input_spec.columns) if input_spec.columns is not None else available
    sources = [source_of[m] for m in model_inputs] if model_inputs else list(read)
    if input_spec.passthrough_columns is not None:
        passthrough = list(input_spec.passthrough_columns)
        missing = [c for c in passthrough if c not in available]
        if missing:
            raise InputError(f"passthrough columns {missing} are not in the input {first_file} (columns: {available})")
    else:
        passthrough = [c for c in read if c not in sources]
    outputs = list(signature.get("outputs", {}))
    clash = sorted(set(passthrough) & set(outputs))
    if clash:
        raise InputError(
            f"passthrough columns {clash} have the same names as model outputs; drop them with "
            "InputSpec.passthrough_columns or rename them in data_prep"
        )
    read = list(dict.fromkeys([*sources, *passthrough]))
    return {"read": read, "model_inputs": model_inputs, "sources": sources, "passthrough": passthrough}


# --- the actor --------------------------------------------------------------------------------------


class ModelReplica:
    """One model copy: fetches (on its own node), verifies and loads the model once, then scores
    batches for the job's life."""

    def __init__(
        self,
        model_uri: str,
        sha256: str,
        plan: dict[str, Any],
        params: dict[str, Any],
        device: str,
        threads: int,
        counter: Any = None,
        max_rows: int | None = None,
        policy: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        from airflow_provider_batchinfer.runtime.flavors import load_predictor

        started = time.monotonic()
        # an object-store model is downloaded here, on the actor's node (once per node: a cache keyed
        # by sha256), not by the driver, whose node may hold no replica at all
        model_dir, manifest = fetch_version(model_uri, sha256, storage_options)
        verified = time.monotonic()
        # torch costs seconds to import: only flavors built on it pay for it (a plain Python model
        # that never touches torch starts without it)
        self.threads = _set_torch_threads(device, threads, load_torch=manifest["flavor"] in TORCH_FLAVORS)
        imported = time.monotonic()
        self.predict = load_predictor(model_dir, manifest, device=device, threads=threads, max_rows=max_rows)
        if self.threads is None and "torch" in sys.modules:  # the user's own class imported it
            self.threads = _set_torch_threads(device, threads, load_torch=True)
        self.plan = plan
        self.params = params
        self.model = f"{manifest['name']}/{manifest['version']}"
        self.counter = counter
        self.policy = policy or {}
        print(f"[batchinfer] replica ready: {self.model} fetched and verified in {verified - started:.2f}s, "
              f"torch imported in {imported - verified:.2f}s, loaded in {time.monotonic() - imported:.2f}s "
              f"on {device}, {self.threads or '-'} torch thread(s)", flush=True)

    def __call__(self, batch: Any) -> Any:
        """Score a batch; with ``on_error="dead_letter"`` rows that raise come back marked instead
        (``runtime/errors.py``), and only a batch that raised pays for finding them."""
        if batch.num_rows == 0:  # a block RESUME filtered empty: nothing to score, nothing to write
            return batch.select(self.plan["passthrough"])
        if self.policy.get("on_error") == "dead_letter":
            return score_isolating(self._score, batch, self.policy.get("keep_columns", []))
        return self._score(batch)

    def _score(self, batch: Any) -> Any:
        import numpy as np
        import pyarrow as pa

        plan = self.plan
        inputs = batch.select(plan["sources"])
        if plan["model_inputs"]:
            inputs = inputs.rename_columns(plan["model_inputs"])
        id_column = self.policy.get("id_column")
        check_batch(inputs, plan["sources"], (id_column, batch.column(id_column)) if id_column else None,
                    self.policy.get("max_value_bytes"))
        inputs = dereference_inputs(inputs, plan.get("dereference"))  # file locations -> contents (column_handling)
        outputs = self.predict(inputs, self.params)
        columns = {c: batch.column(c) for c in plan["passthrough"]}
        for name, values in outputs.items():
            if isinstance(values, np.ndarray) and values.ndim == 2:
                flat = pa.array(np.ascontiguousarray(values).reshape(-1))
                arr = pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
            elif isinstance(values, (pa.Array, pa.ChunkedArray)):
                arr = values
            else:
                arr = pa.array(values)
            if len(arr) != batch.num_rows:
                raise ValueError(
                    f"model {self.model} returned {len(arr)} values for output {name!r} on a batch of {batch.num_rows} rows"
                )
            columns[name] = arr
        if self.counter is not None:
            self.counter.add.remote(batch.num_rows)
        return pa.table(columns)


# flavors whose predictor runs on torch: their replicas import it up front and pin its threads
TORCH_FLAVORS = frozenset({"torchscript", "sentence_transformers", "text_generation", "image_classification"})


def _set_torch_threads(device: str, threads: int, load_torch: bool = True) -> int | None:
    """Ray pins OMP_NUM_THREADS=1 in an actor that reserves one CPU; a CPU model should use the
    threads the pool was sized for instead, or it runs at a fraction of the machine's speed.
    Returns the intra-op threads torch will use (None without torch, or when ``load_torch`` is
    False and nothing imported it yet)."""
    if device == "cpu":
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["MKL_NUM_THREADS"] = str(threads)
    if not load_torch and "torch" not in sys.modules:
        return None
    try:
        import torch
    except ImportError:
        return None
    if device == "cpu":
        torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


# --- the driver -------------------------------------------------------------------------------------


def _log_progress(counter: Any, total: int, started: float, interval: float, stop: threading.Event, stats: dict) -> None:
    """Log rows scored, the current and overall rate and an ETA every ``interval`` seconds."""
    import ray

    last_rows, last_t = 0, started
    while not stop.wait(interval):
        try:
            done = ray.get(counter.get.remote(), timeout=10)
        except Exception:  # progress is best-effort; the job's result does not depend on it
            continue
        now = time.monotonic()
        if done and "first_rows_at" not in stats:
            stats["first_rows_at"], stats["first_rows"] = now, done
        current = (done - last_rows) / max(now - last_t, 1e-9)
        overall = done / max(now - started, 1e-9)
        rate = current or overall
        eta = f"{(total - done) / rate:,.0f}s" if rate > 0 else "unknown (model replicas starting)"
        pct = 100.0 * done / total if total else 100.0
        print(f"[batchinfer] progress: {done:,}/{total:,} rows ({pct:.1f}%), {current:,.1f} rows/s now, "
              f"{overall:,.1f} rows/s overall, ETA {eta}", flush=True)
        last_rows, last_t = done, now


def size_actor_pool(job: JobSpec, cluster: dict[str, float]) -> dict[str, Any]:
    """Ray resources for the actor pool, never every CPU of the cluster: a pool that holds them all
    starves the read and write tasks and the job hangs (checked on Ray 2.60)."""
    cpus = float(cluster.get("CPU", 0))
    gpus = float(cluster.get("GPU", 0))
    notes = []
    if job.num_gpus > 0 and gpus < job.num_gpus:
        raise JobError(
            f"JobSpec.num_gpus={job.num_gpus} per replica, but the Ray cluster has {gpus:g} GPU(s); run on a GPU "
            "cluster (launcher ray_jobs) or set num_gpus=0"
        )
    replicas = job.replicas
    num_cpus = job.num_cpus
    spare = max(cpus - 1, 0)
    if num_cpus > spare and cpus > 0:
        notes.append(f"num_cpus={num_cpus:g} per replica leaves no CPU for reading and writing on a {cpus:g}-CPU cluster; using {max(spare, 0.5):g}")
        num_cpus = max(spare, 0.5)
    if num_cpus > 0 and replicas * num_cpus > max(spare, num_cpus):
        fit = max(1, int(max(spare, num_cpus) // num_cpus))
        notes.append(f"replicas={replicas} x {num_cpus:g} CPU would hold every CPU of the cluster ({cpus:g}); using {fit} replica(s)")
        replicas = fit
    if job.num_gpus > 0:
        replicas = min(replicas, max(1, int(gpus // job.num_gpus)))
        device = "cuda"
        threads = max(1, int(num_cpus))
    else:
        device = "cpu"
        threads = max(1, int(cpus // replicas)) if cpus else 1
    return {"replicas": replicas, "num_cpus": num_cpus, "num_gpus": job.num_gpus, "device": device,
            "threads": threads, "notes": notes}


def ray_init_kwargs(spec: dict[str, Any], environ: Any) -> dict[str, Any]:
    """``ray.init`` arguments: the configured cluster, else a fresh local Ray for this job.

    ``ray.init()`` with no address attaches to whatever cluster ``ray start`` last recorded in
    ``/tmp/ray/ray_current_cluster`` (someone else's, or a dead one it then waits on forever), so
    "no address" must say ``"local"`` explicitly."""
    address = (spec.get("ray") or {}).get("address") or environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:
        kwargs.update(address="local", include_dashboard=False)
    return kwargs


def run(spec_location: str) -> dict[str, Any]:
    started_at = datetime.now(timezone.utc)
    t0 = time.monotonic()
    spec_stage = Stage.open(spec_location)
    try:
        spec = spec_stage.read_json()
    except FileNotFoundError as exc:
        raise JobError(f"job spec {spec_location} does not exist") from exc
    if spec.get("format") != JOB_FORMAT:
        raise JobError(f"{spec_location} is not a {JOB_FORMAT} job spec")
    storage = spec.get("storage_options")
    run_dir = Stage.open(spec["run_dir"], storage)
    attempt = spec["attempt"]
    input_spec = InputSpec.from_dict(spec["input_spec"])
    job = JobSpec.from_dict(spec["job_spec"])
    model = spec["model"]
    print(f"[batchinfer] job {spec['job_id']} attempt {attempt}: model {model['name']}/{model['version']} "
          f"({model['flavor']}, sha256 {model['sha256'][:12]}…) -> {run_dir.location}", flush=True)

    # 1. everything that can be checked before Ray starts
    registry = ModelRegistry(spec["registry_root"], storage)
    if registry.is_local:
        verify_local_copy(registry.local_copy(model["name"], model["version"]), model["sha256"])
    else:  # the actors download and re-hash it on their own nodes; here only what a listing shows
        registry.check_listing(model["name"], model["version"], model["sha256"])
    files = list_input_files(spec["input"]["locations"], storage)
    input_rows, schema = inspect_input(files, storage)
    plan = with_id_column(plan_columns(schema, model["signature"], input_spec, files[0]), input_spec.id_column)
    if input_spec.id_column:
        check_unique_ids(files, input_spec.id_column, storage)
    kept = _resume_state(spec, run_dir, input_spec)
    todo_rows = input_rows - kept["rows"] - kept["error_rows"]
    batch_rows = transfer_rows(model["flavor"], job.max_batch_rows, row_bytes(files[0], plan["read"], storage))
    plan["dereference"] = dereference_plan(input_spec.column_handling, plan["sources"], plan["model_inputs"],
                                           model["signature"].get("inputs", {}), spec.get("file_roots") or [], storage)
    engine = llm.resolve_engine(model["flavor"], job, spec.get("llm_engine"))
    if engine == "vllm":
        llm.check_vllm_job(job)  # no vllm or no GPUs asked for: fail before Ray starts
    print(f"[batchinfer] input: {input_rows:,} rows in {len(files)} file(s); model reads {plan['sources']}, "
          f"passes through {plan['passthrough']}", flush=True)

    # 2. the Ray Data pipeline
    import ray
    import ray.data

    init_kwargs = ray_init_kwargs(spec, os.environ)
    # S3 credentials reach the workers from this process's environment, never a file; so does the
    # node-local model cache directory when one is configured
    env_vars = {**worker_env(), **{k: os.environ[k] for k in (MODEL_CACHE_ENV,) if os.environ.get(k)}}
    if env_vars:
        init_kwargs["runtime_env"] = {"env_vars": env_vars}
    ray.init(**init_kwargs)
    t_ray = time.monotonic()
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        if engine == "vllm":
            llm.check_cluster(job, ray.cluster_resources())
        pool = size_actor_pool(job, ray.cluster_resources())
        for note in pool["notes"]:
            print(f"[batchinfer] resources: {note}", flush=True)
        print(f"[batchinfer] actor pool: {pool['replicas']} replica(s) x {pool['num_cpus']:g} CPU / "
              f"{pool['num_gpus']:g} GPU on {pool['device']}, {pool['threads']} thread(s) each, "
              f"batches of {batch_rows:,} rows, model calls of at most {job.max_batch_rows:,} rows", flush=True)
        counter = ray.remote(num_cpus=0)(ProgressCounter).remote()
        stats: dict[str, Any] = {}
        stop = threading.Event()
        ticker = threading.Thread(
            target=_log_progress, args=(counter, todo_rows, time.monotonic(), job.progress_interval_s, stop, stats),
            daemon=True,
        )
        ds = ray.data.read_parquet(files, columns=plan["read"], filesystem=Stage.open(files[0], storage).fs if storage else None)
        if len(kept["ids"]):
            from airflow_provider_batchinfer.runtime.resume import drop_done

            ds = ds.map_batches(drop_done, fn_kwargs={"id_column": input_spec.id_column, "done": kept["ids"]},
                                batch_size=None, batch_format="pyarrow")
        if job.rows_per_part:  # commit granularity for RESUME: one part per this many rows
            ds = ds.repartition(target_num_rows_per_block=job.rows_per_part)
        map_kwargs: dict[str, Any] = {}
        if job.memory:
            map_kwargs["memory"] = job.memory
        if engine == "vllm":  # ray.data.llm runs its own stages and engine actors
            print(f"[batchinfer] engine: vLLM via ray.data.llm, {job.replicas} engine replica(s) x "
                  f"{llm.gpus_per_replica(job)} GPU(s)", flush=True)
            ds = llm.build_pipeline(ds, registry.local_copy(model["name"], model["version"]), model["signature"], plan, input_spec.params, job, counter)
        else:
            ds = ds.map_batches(
                ModelReplica,
                fn_constructor_kwargs={
                    "model_uri": model["uri"],
                    "sha256": model["sha256"],
                    "plan": plan,
                    "params": input_spec.params,
                    "device": pool["device"],
                    "threads": pool["threads"],
                    "counter": counter,
                    "max_rows": job.max_batch_rows,
                    "policy": {"on_error": job.on_error, "keep_columns": plan["passthrough"],
                               "id_column": input_spec.id_column, "max_value_bytes": job.max_value_bytes},
                    "storage_options": storage,  # no credentials: the workers get those from worker_env()
                },
                batch_size=batch_rows,
                batch_format="pyarrow",
                compute=ray.data.ActorPoolStrategy(size=pool["replicas"]),
                num_cpus=pool["num_cpus"],
                num_gpus=pool["num_gpus"] or None,
                **map_kwargs,
            )
        sink = make_datasink(run_dir.location, attempt, storage, error_columns=plan["passthrough"])
        ticker.start()
        t_map = time.monotonic()
        try:
            ds.write_datasink(sink)
        finally:
            stop.set()
        t_done = time.monotonic()
    finally:
        ray.shutdown()

    # 3. reconcile, fence, commit
    new_rows = sum(p["rows"] for p in sink.parts)
    new_errors = sum(p["rows"] for p in sink.error_parts)
    parts = sorted(kept["files"] + sink.parts, key=lambda p: p["name"])
    error_parts = sorted(kept["error_files"] + sink.error_parts, key=lambda p: p["name"])
    output_rows = kept["rows"] + new_rows
    error_rows = kept["error_rows"] + new_errors
    if output_rows + error_rows != input_rows:
        raise JobError(
            f"row counts do not reconcile: {input_rows:,} input rows but {output_rows:,} written + {error_rows:,} "
            f"dead-lettered ({kept['rows'] + kept['error_rows']:,} kept from earlier attempts); not committing "
            f"(parts of attempt {attempt} stay in {run_dir.location} without a {SUCCESS_MARKER})"
        )
    check_error_fraction(error_rows, input_rows, job, run_dir, error_parts)
    finished_at = datetime.now(timezone.utc)
    map_seconds = t_done - t_map
    manifest = {
        "format": MANIFEST_FORMAT,
        "run_dir": run_dir.location,
        "files": parts,
        "error_files": error_parts,
        "counts": {"input_rows": input_rows, "output_rows": output_rows, "error_rows": error_rows},
        "error_policy": {"on_error": job.on_error, "max_error_fraction": job.error_fraction_limit},
        "resume": {"resumed": bool(spec.get("resume")), "kept_files": len(kept["files"]) + len(kept["error_files"]),
                   "kept_rows": kept["rows"] + kept["error_rows"], "processed_rows": new_rows + new_errors,
                   "removed_files": kept["removed"]},
        "columns": {"passthrough": plan["passthrough"], "outputs": list(model["signature"].get("outputs", {}))},
        "model": {k: model[k] for k in ("name", "version", "flavor", "sha256", "uri")},
        "input": {"locations": spec["input"]["locations"], "files": files},
        "job": {"id": spec["job_id"], "attempt": attempt, "launcher": spec.get("launcher", "local"),
                "replicas": pool["replicas"], "device": pool["device"]},
        "airflow": spec.get("airflow", {}),
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "timings": {
            "total_s": round(time.monotonic() - t0, 3),
            "ray_init_s": round(t_ray - t0, 3),
            "pipeline_s": round(map_seconds, 3),
            "rows_per_s": round((new_rows + new_errors) / map_seconds, 2) if map_seconds > 0 else None,
            "steady_rows_per_s": _steady_rate(stats, t_done, new_rows + new_errors),
        },
    }
    commit_manifest(run_dir, attempt, manifest)
    if error_rows:
        print(f"[batchinfer] dead-lettered {error_rows:,} row(s) into {len(error_parts)} file(s) under "
              f"{run_dir.location}/_errors/", flush=True)
    print(f"[batchinfer] committed {output_rows:,} rows in {len(parts)} part(s) to {run_dir.location} "
          f"({manifest['timings']['rows_per_s']} rows/s over the pipeline, {manifest['timings']['total_s']}s total)",
          flush=True)
    return manifest


def with_id_column(plan: dict[str, Any], id_column: str | None) -> dict[str, Any]:
    """The plan with ``id_column`` read and passed through: predictions and dead-lettered rows
    always carry the row's id, and RESUME finds finished rows by it."""
    if not id_column or id_column in plan["passthrough"]:
        return plan
    return {**plan, "passthrough": [*plan["passthrough"], id_column],
            "read": list(dict.fromkeys([*plan["read"], id_column]))}


def _resume_state(spec: dict[str, Any], run_dir: Stage, input_spec: InputSpec) -> dict[str, Any]:
    """What earlier attempts of this run committed (SaveMode.RESUME), or nothing."""
    import numpy as np

    if not spec.get("resume"):
        return {"files": [], "error_files": [], "rows": 0, "error_rows": 0, "ids": np.array([]), "removed": []}
    from airflow_provider_batchinfer.runtime.resume import collect_committed

    if not input_spec.id_column:
        raise JobError("SaveMode.RESUME needs InputSpec.id_column to know which rows are done")
    owner = run_dir.child(JOB_SPEC_FILE).read_json()
    if owner.get("attempt") != spec["attempt"]:  # a late zombie must not delete another attempt's parts
        raise FencedError(f"attempt {spec['attempt']} does not own {run_dir.location} (attempt {owner.get('attempt')} "
                          "does); not resuming")
    kept = collect_committed(run_dir, input_spec.id_column)
    print(f"[batchinfer] resume: keeping {len(kept['files'])} part(s) with {kept['rows']:,} row(s) and "
          f"{len(kept['error_files'])} dead-letter file(s) with {kept['error_rows']:,} row(s) from earlier attempts",
          flush=True)
    return kept


def check_error_fraction(error_rows: int, input_rows: int, job: JobSpec, run_dir: Stage,
                         error_parts: list[dict[str, Any]]) -> None:
    """Fail (nothing committed) when more rows were dead-lettered than ``max_error_fraction`` allows,
    quoting the first messages so the log says what went wrong."""
    if not error_rows or error_rows <= job.error_fraction_limit * input_rows:
        return
    samples: list[str] = []
    try:
        import pyarrow.parquet as pq

        first = run_dir.child(*error_parts[0]["name"].split("/"))
        with first.fs.open_input_file(first.path) as f:
            samples = pq.read_table(f, columns=["error"]).column("error").to_pylist()[:3]
    except Exception:  # the samples only decorate the message
        pass
    raise JobError(
        f"{error_rows:,} of {input_rows:,} rows ({100 * error_rows / input_rows:.2f}%) could not be scored, above "
        f"JobSpec.max_error_fraction={job.error_fraction_limit:g}; not committing. First errors: "
        f"{'; '.join(samples) or 'see the _errors/ files'}. The failed rows are in {run_dir.location}/_errors/"
    )


def commit_manifest(run_dir: Stage, attempt: str, manifest: dict[str, Any]) -> None:
    """The commit: refuse when another attempt owns the run directory (its ``_job.json`` names a
    newer attempt: this one is a zombie), check the manifest against the files, then write
    ``_SUCCESS`` last."""
    owner = run_dir.child(JOB_SPEC_FILE).read_json()
    if owner.get("attempt") != attempt:
        raise FencedError(
            f"attempt {attempt} is no longer the owner of {run_dir.location}: attempt {owner.get('attempt')} "
            f"(try {owner.get('airflow', {}).get('try_number')}) took over; not committing"
        )
    validate_manifest(run_dir, manifest)
    run_dir.child(SUCCESS_MARKER).write_json(manifest)


def _steady_rate(stats: dict, t_done: float, rows: int) -> float | None:
    """Rows/s from the first progress tick that saw rows to the end: excludes Ray and actor start-up."""
    first = stats.get("first_rows_at")
    if first is None or t_done - first <= 0:
        return None
    return round((rows - stats["first_rows"]) / (t_done - first), 2)


_RAY_WRAPPERS = ("UserCodeException", "RayTaskError", "RayActorError", "RaySystemError")


# markers that carry no message of their own: Ray Data raises a failed datasink's error "from
# SystemException()", which hides the Ray wrapper's ``cause`` from a plain __cause__ walk
_EMPTY_MARKERS = ("SystemException",)


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """The exception and what lies behind it, one step at a time: ``__cause__``, else what a Ray
    wrapper carries as ``cause`` (the worker's own exception), else ``__context__``. A message-less
    marker as ``__cause__`` is stepped over, so the wrapper's ``cause`` is still reached."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not c for c in chain):
        chain.append(current)
        explicit = current.__cause__
        if explicit is not None and type(explicit).__name__ in _EMPTY_MARKERS:
            explicit = None
        cause = getattr(current, "cause", None)
        current = explicit or (cause if isinstance(cause, BaseException) else None) or current.__context__
    return chain


def is_permanent(exc: BaseException) -> bool:
    """Whether any error in the chain says no retry can fix it (an S3 bucket that does not exist,
    access denied): the operator then fails the task without Airflow retries. A store that stopped
    answering mid-job is not permanent here: the operator reached it just before the launch, so it
    is an outage (a crashed or restarting server), and the task's retries are what recovers it."""
    return any(getattr(e, "permanent", False) and not getattr(e, "unreachable", False)
               for e in _exception_chain(exc))


def _root_message(exc: BaseException) -> str:
    """The user-facing message of an error raised inside a Ray task. Ray wraps it in layers
    (UserCodeException -> RayTaskError(ValueError) -> ValueError) whose own text is advice about
    retries or a traceback; the innermost non-wrapper exception is what the user needs to see,
    unless one of ours (a StageError: it names the bucket, key and what to do) is in the chain."""
    chain = _exception_chain(exc)
    plain = [e for e in chain if not any(w in type(e).__name__ for w in _RAY_WRAPPERS + _EMPTY_MARKERS)]
    if plain:
        ours = [e for e in plain if isinstance(e, StageError)]
        root = ours[0] if ours else plain[-1]
        lines = [line for line in _RAY_RETRY_NOTE.split(str(root))[0].strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else ""
        name = type(root).__name__
        return last if last.startswith(name) else f"{name}: {last}" if last else name
    # Ray only carries the user's exception as text inside the wrapper's traceback
    for wrapper in chain:
        for match in _ERROR_LINE.finditer(str(wrapper)):
            name = match.group("name")
            if not name.startswith("ray.") and not any(w in name for w in _RAY_WRAPPERS):
                return f"{name.rsplit('.', 1)[-1]}: {match.group('msg').strip()}"
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip() if lines else ''}"


# Ray Data appends its retry advice to a failed task's exception message ("Failed to write after
# 1/1 attempts (total backoff 0.0s).\nTo change retry attempts, ..."); it is not the error
_RAY_RETRY_NOTE = re.compile(r"\n\s*Failed to [^\n]* after \d+/\d+ attempts \(total backoff")
_ERROR_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (?P<msg>.*)$", re.MULTILINE)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m airflow_provider_batchinfer.runtime")
    parser.add_argument("--spec", required=True, help="location of the job spec (_job.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        manifest = run(args.spec)
    except Exception as exc:  # the one place that turns any failure into a clear last line
        message = _root_message(exc)
        log.debug("job failed", exc_info=True)
        print(ERROR_PREFIX + json.dumps({"error": message, "type": type(exc).__name__,
                                         "permanent": is_permanent(exc)}), flush=True)
        return 2 if isinstance(exc, (InputError, JobError, StageError, ValueError)) else 1
    print(RESULT_PREFIX + json.dumps({"rows": manifest["counts"]["output_rows"], "files": len(manifest["files"])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
