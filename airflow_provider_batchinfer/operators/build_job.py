"""The operator's :class:`JobFile`: everything the runtime needs, resolved on the Airflow side."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_provider_batchinfer.contract import INPUT_DIR, JobFile, ModelRef, new_attempt_id
from airflow_provider_batchinfer.store.locations import sanitize_run_key

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract import RunOwner
    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.launchers import Launcher
    from airflow_provider_batchinfer.registry import ModelVersion
    from airflow_provider_batchinfer.store.stage import Stage


def build_job_file(
    hook: ModelServiceHook,
    input_spec: InputSpec,
    job_spec: JobSpec,
    launcher: Launcher,
    owner: RunOwner,
    mv: ModelVersion,
    run_dir: Stage,
    input_locations: list[str] | None,
    resume: bool,
    identity: str,
) -> JobFile:
    """A new attempt's job file: the model pinned by sha256, the specs, where to read and write,
    the connection's settings the runtime needs (never its credentials: see ``runtime_env()``)."""
    attempt = new_attempt_id(owner.try_number)
    config = hook.config
    return JobFile(
        job_id=f"batchinfer-{sanitize_run_key(owner.dag_id)}-{sanitize_run_key(owner.task_id)}-{attempt}",
        attempt=attempt,
        launcher=launcher.name,
        run_dir=run_dir.location,
        input_locations=tuple(input_locations or [run_dir.child(INPUT_DIR).location]),
        input_spec=input_spec,
        job_spec=job_spec,
        model=ModelRef(
            name=mv.name, version=mv.version, flavor=mv.flavor, sha256=mv.sha256, uri=mv.uri, signature=mv.signature
        ),
        registry_root=config.registry_root,
        airflow=owner,
        file_roots=tuple(config.file_roots),  # InputSpec.column_handling reads only below these
        allowed_url_hosts=tuple(config.allowed_url_hosts),  # messages' http(s) URLs are fetched only from these
        llm_engine=config.llm_engine,
        ray_address=launcher.job_ray_address,  # a Jobs API driver finds its cluster by itself
        storage_options=hook.runtime_storage_options(),
        resume=resume,
        submission_id=launcher.job_name(owner, attempt, identity),
        identity=identity,
        prices=dict(config.prices),  # the usage's cost and JobSpec(max_cost=...)
    )
