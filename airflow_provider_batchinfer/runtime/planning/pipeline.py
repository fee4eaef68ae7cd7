"""Planning, before any compute: which columns to read, what the model gets, what passes through,
and the actor pool that runs in what the job reserved. Pure functions, tested without Ray."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

from airflow_provider_batchinfer.runtime.planning.resources import IO_TASK_CPU
from airflow_provider_batchinfer.store.inputs import InputError

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec
    from airflow_provider_batchinfer.runtime.planning.resources import Reservation


class _ColumnPlanBase(TypedDict):
    read: list[str]
    model_inputs: list[str]
    sources: list[str]
    passthrough: list[str]


class ColumnPlan(_ColumnPlanBase, total=False):
    """What to read (``read``), the model's input names (``model_inputs``) and the input columns they
    come from (``sources``, same order), what is copied to the output (``passthrough``), and, once
    the driver adds it, how file columns are dereferenced (``dereference``, see ``dereference.py``)."""

    dereference: dict[str, Any] | None
    # model inputs whose null/NaN values reach the model as missing values (tree flavors)
    missing_ok: list[str]


class ActorPool(TypedDict):
    """The actor pool a job gets on a cluster, and why it differs from what was asked (``notes``):
    at most ``replicas`` (reserved), at least ``min_replicas``, over ``num_workers`` nodes, each
    replica ``num_cpus`` / ``num_gpus`` / ``memory`` (bytes); read and write tasks take ``io_cpus`` each; the whole
    reservation is ``reserved_cpus`` / ``reserved_gpus``."""

    replicas: int
    min_replicas: int
    num_workers: int
    num_cpus: float
    num_gpus: float
    io_cpus: float
    memory: int
    reserved_cpus: float
    reserved_gpus: float
    device: str
    threads: int
    notes: list[str]


def _arrow_kind(arrow_type: pa.DataType) -> str:
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


def _accepts(signature_dtype: str, arrow_type: pa.DataType) -> bool:
    kind = _arrow_kind(arrow_type)
    want = signature_dtype.lower()
    if want in ("any", ""):
        return True
    if want.startswith("list") or want.endswith("]"):
        return kind == "list"
    if want in ("string", "str", "text"):
        return kind == "string"
    if want == "category":  # categories by name (strings, dictionaries) or by code (ints)
        return kind in ("string", "int", "bool") or pa_is_dictionary(arrow_type)
    if want.startswith(("float", "double", "int", "uint", "number")):
        return kind in ("int", "float", "bool")
    if want == "bool":
        return kind in ("bool", "int")
    return True


def pa_is_dictionary(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_dictionary(arrow_type))


def _model_sources(available: list[str], signature: Mapping[str, Any], input_spec: InputSpec) -> dict[str, str]:
    """``{model input: input column}``; an "optional" input (a text model's per-row sampling_params)
    is read only when the input has it."""
    mapped = input_spec.column_mapping.values()
    model_inputs = [
        m
        for m, dtype in signature.get("inputs", {}).items()
        if str(dtype).lower() != "optional" or m in available or m in mapped
    ]
    source_of = {model: model for model in model_inputs}
    for src, model in input_spec.column_mapping.items():
        if model not in source_of:
            raise InputError(
                f"InputSpec.column_mapping maps {src!r} to {model!r}, but the model's inputs are {model_inputs}"
            )
        source_of[model] = src
    return source_of


def _check_sources(schema: pa.Schema, signature: Mapping[str, Any], source_of: dict[str, str], first_file: str) -> None:
    available = list(schema.names)
    for model, src in source_of.items():
        if src not in available:
            hint = (
                f"; map another column to it with InputSpec.column_mapping={{'<column>': {model!r}}}"
                if src == model
                else ""
            )
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


def plan_columns(schema: pa.Schema, signature: Mapping[str, Any], input_spec: InputSpec, first_file: str) -> ColumnPlan:
    """Decide what to read, what the model gets and what passes through, failing with the column's
    name before any compute when the input cannot match the model's signature."""
    available = list(schema.names)
    source_of = _model_sources(available, signature, input_spec)
    model_inputs = list(source_of)
    if input_spec.columns is not None:
        unknown = [c for c in input_spec.columns if c not in available]
        if unknown:
            raise InputError(f"InputSpec.columns {unknown} are not in the input {first_file} (columns: {available})")
    _check_sources(schema, signature, source_of, first_file)
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


def with_id_column(plan: ColumnPlan, id_column: str | None) -> ColumnPlan:
    """The plan with ``id_column`` read and passed through: predictions and dead-lettered rows
    always carry the row's id, and RESUME finds finished rows by it."""
    if not id_column or id_column in plan["passthrough"]:
        return plan
    out: ColumnPlan = {
        **plan,
        "passthrough": [*plan["passthrough"], id_column],
        "read": list(dict.fromkeys([*plan["read"], id_column])),
    }
    return out


def size_actor_pool(job: JobSpec, res: Reservation) -> ActorPool:
    """The actor pool that runs in a reservation (``runtime/planning/resources.py``): it autoscales between
    ``num_workers`` replicas (one per node) and the replicas reserved, never beyond, and the notes
    say why it differs from what was asked."""
    notes: list[str] = []
    if res.replicas < job.replicas:
        notes.append(
            f"replicas={job.replicas} asked for, {res.replicas} reserved: the cluster had room for no more "
            f"beside its other jobs ({res.describe()})"
        )
    busiest = max(res.per_node)
    if job.num_gpus > 0:
        device, threads = "cuda", max(1, int(job.num_cpus))
    else:  # a replica's torch threads: its node's share of the reservation, rounded
        device, threads = "cpu", max(1, int((busiest * res.num_cpus + res.io_cpus / 2) / busiest + 0.5))
    return {
        "replicas": res.replicas,
        "min_replicas": res.min_replicas,
        "num_workers": len(res.per_node),
        "num_cpus": res.num_cpus,
        "num_gpus": res.num_gpus,
        "io_cpus": IO_TASK_CPU,
        "memory": res.replica_memory,
        "reserved_cpus": res.cpus,
        "reserved_gpus": res.gpus,
        "device": device,
        "threads": threads,
        "notes": notes,
    }


def batch_rows_for_input(transfer: int, max_rows: int, input_rows: int, files: int) -> int:
    """The rows per batch handed to a replica, never above what one input file holds on average.

    Why: Ray Data bundles read blocks until a bundle holds ``batch_size`` rows, and a bundle that
    never gets there (every block smaller than the batch: a small input) waits for the end of the
    read to be flushed, which on Ray 2.60 came ~20-25 s late (a 10,000-row MLP job: pipeline 29 s,
    a 100,000-row one: 7 s). A batch no larger than a file's rows is dispatched as soon as its block
    is read. (``max_rows`` still bounds each model call; a smaller batch only means a smaller call.)

    Why the read ended late (Ray Data's log): inside a placement group Ray Data budgets with the
    group's bundles, which name no object store memory, so every operator's output budget is zero.
    The block waiting in the model's queue counts against the read's, the read stays
    ``backpressured: outputs(ResourceBudget)``, and only the idle detector (two 10 s checks) lets it
    finish. Two ways out were measured and not taken: naming ``object_store_memory`` in the bundles
    crashes the raylet of Ray 2.60 when the group is removed; showing it to Ray Data alone (a
    ``PlacementGroup`` handle whose bundle cache names it) removed the stall (5.7 s instead of 26.6 s
    with this cap lifted) but made the 1M-row MLP on the actor pool ~15% slower on two cores
    (8.7-9.7 s against 7.7-8.1 s: the reads ran ahead of the one replica and took its cores)."""
    per_file = -(-input_rows // max(files, 1)) if input_rows else transfer
    return max(1, min(transfer, per_file))


def io_tasks(pool: ActorPool) -> int:
    """# how many read (and write) tasks run at once: one per replica, at least two. Each task
    is a Ray worker process; at ``io_cpus`` (0.25) each, Ray would otherwise start eight per two
    CPUs at the job's start, and their start-up (Python, Ray, pyarrow: ~1 CPU-second each) competes
    with the replicas' own (torch's import took 4-6 s instead of 1.5 s beside them). pyarrow reads
    and writes a block on several threads, so one task per replica keeps up with the model."""
    return max(2, int(pool["replicas"]))
