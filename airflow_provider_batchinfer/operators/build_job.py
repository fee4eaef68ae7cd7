"""The operator's :class:`JobFile`: everything the runtime needs, resolved on the Airflow side.

A SQL input is handed to the job: the Airflow worker resolves the connection and runs no query.
The job reads the query (``runtime/inputs/sql_input.py``): in shards on Ray where the database can
hash a sharding column, else streamed by its driver, into ``_input/<attempt>/``. Here the connection
becomes a SQLAlchemy URL (the hook's ``sqlalchemy_url``, else its ``get_uri()``), which may hold a
password: it goes to the launcher as the job's secret (``Launcher.job_secrets``), delivered the way
the job's storage credentials are, and never into ``_job.json``, the Ray job's metadata or a log.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_batchinfer.contract import INPUT_DIR, ContractError, JobFile, ModelRef, new_attempt_id
from airflow_provider_batchinfer.contract.specs.tables import is_table_input
from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV, SqlInput
from airflow_provider_batchinfer.operators.errors import input_error
from airflow_provider_batchinfer.store.inputs import InputError, list_input_files
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


def input_locations_of(hook: ModelServiceHook, given: str | list[str] | None, on_empty: str) -> list[str] | None:
    """The Parquet input, resolved and checked (None: a table or a SQL input, which the job reads)."""
    if given is None or is_table_input(given):  # a table: the job reads its snapshot
        return None
    raw = [given] if isinstance(given, str) else list(given)
    locations = [hook.resolve_location(loc) for loc in raw]
    try:
        list_input_files(locations, hook.storage_options)
    except InputError as exc:  # an empty one may skip the task, or go on to commit 0 rows
        error = input_error(exc, on_empty)
        if error is not None:
            raise error from exc
    return locations


def bind_sql(
    job: JobFile,
    sql: str,
    conn_id: str,
    chunk_rows: int,
    shard_column: str | None,
    shard_hash_fn: str,
    kept_digest: str | None,
) -> JobFile:
    """The job file with its query (``kept_digest``: a RESUME's earlier result, which the job
    compares with the result it reads). A query the contract refuses fails the task (no retry)."""
    try:
        query = SqlInput(
            query=sql,
            conn_id=conn_id,
            chunk_rows=chunk_rows,
            shard_column=shard_column,
            shard_hash_fn=shard_hash_fn,
            kept_digest=kept_digest,
        )
    except ContractError as exc:
        raise AirflowFailException(str(exc)) from exc
    return dataclasses.replace(job, sql_input=query)


def database_url(conn_id: str) -> str:
    """The SQLAlchemy URL of the Airflow SQL connection ``conn_id``. Fails the task (no retry) for a
    connection whose hook is not a SQL hook."""
    from airflow.sdk import BaseHook

    db_hook: Any = BaseHook.get_connection(conn_id).get_hook()
    if not hasattr(db_hook, "get_conn") or not hasattr(db_hook, "get_uri"):
        raise AirflowFailException(f"connection {conn_id!r} is not a SQL connection (its hook has no get_conn)")
    try:
        return str(db_hook.sqlalchemy_url.render_as_string(hide_password=False))
    except (NotImplementedError, AttributeError):  # hooks that build no URL object: their own URI
        return str(db_hook.get_uri())


def sql_job_secrets(conn_id: str) -> dict[str, str]:
    """What the job is given to reach the database: its URL, as a secret variable."""
    return {SQL_URL_ENV: database_url(conn_id)}
