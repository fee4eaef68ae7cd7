"""Which run a task instance is and where its rows go: the owner recorded in ``_job.json`` and the
run directory, both derived from the task instance alone so that every try of a run agrees; and
the model and run directory a try resolves before anything has a side effect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_batchinfer.contract import ContractError, JobFile, RunOwner
from airflow_provider_batchinfer.contract.specs import OutputSpec
from airflow_provider_batchinfer.registry import RegistryError
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.locations import join, sanitize_run_key
from airflow_provider_batchinfer.store.s3 import check_bucket, is_s3

if TYPE_CHECKING:
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.launchers.base import TaskLog
    from airflow_provider_batchinfer.registry import ModelVersion
    from airflow_provider_batchinfer.store.stage import Stage


def run_owner(ti: Any) -> RunOwner:
    """The DAG, task, run, try and map index a claim records."""
    map_index = getattr(ti, "map_index", -1)
    return RunOwner(
        dag_id=ti.dag_id,
        task_id=ti.task_id,
        run_id=ti.run_id,
        try_number=int(ti.try_number),
        map_index=-1 if map_index is None else int(map_index),
    )


def run_directory(hook: ModelServiceHook, stage_location: str | None, base_stage_location: str | None, ti: Any) -> str:
    """``stage_location`` as given, or ``<base>/<sanitized run_id>[/map-<i>]``: stable across tries of
    one run (so retries overwrite), distinct across runs, backfills and manual triggers. The rendered
    values are checked again as an ``OutputSpec`` (a template may render to nothing)."""
    OutputSpec(stage_location=stage_location, base_stage_location=base_stage_location)
    if stage_location:
        return hook.resolve_location(stage_location)
    location = join(hook.resolve_location(base_stage_location or ""), sanitize_run_key(ti.run_id))
    map_index = getattr(ti, "map_index", -1)
    if map_index is not None and map_index >= 0:
        location = join(location, f"map-{map_index}")
    return location


def resolve(
    hook: ModelServiceHook, model: str, version: str, location: str, save_mode: str, log: TaskLog
) -> tuple[ModelVersion, Stage]:
    """The model version (a registry error fails the task, no retry) and the opened run directory
    (an S3 bucket that does not exist fails before anything is written)."""
    try:
        mv = hook.get_model(model, version)
    except RegistryError as exc:
        raise AirflowFailException(str(exc)) from exc
    run_dir = hook.open_stage(location)
    if is_s3(location):
        check_bucket(run_dir.fs, location)
    log.info(
        "Model %s/%s (%s, sha256 %s) -> run directory %s [%s]",
        mv.name,
        mv.version,
        mv.flavor,
        mv.sha256[:12],
        location,
        save_mode,
    )
    return mv, run_dir


def claim_for_reattach(run_dir: Stage, log: TaskLog) -> JobFile | None:
    """The run directory's claim; None (nothing to re-attach to) when it cannot be read:
    ``rundir.prepare`` decides what such a directory may become."""
    try:
        return rundir.read_claim(run_dir)
    except ContractError as exc:
        log.warning("Not re-attaching: %s", exc)
        return None
