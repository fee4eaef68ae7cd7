"""How the operator's errors become Airflow's: permanent ones fail the task without retries; and
the constructor's argument checks (run when the DAG file is parsed, so a wrong combination is an
import error shown in the UI, not a failure at 2 a.m.)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from airflow_provider_batchinfer.contract import ContractError
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec, SaveMode, SpecError
from airflow_provider_batchinfer.contract.specs.tables import check_table_input_argument
from airflow_provider_batchinfer.store.inputs import EmptyInputError, InputError
from airflow_provider_batchinfer.store.s3 import S3StageError

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator, Context

    from airflow_provider_batchinfer.launchers.base import Outcome

_R = TypeVar("_R")


def fail_on_s3_errors(execute: Callable[..., _R]) -> Callable[..., _R]:
    """S3 errors that no retry can fix (no such bucket, access denied, unreachable endpoint) fail the
    task without Airflow retries; others (transient ones that outlived pyarrow's own retries) leave
    the task to its retries. Either way the message names the bucket and key."""

    @functools.wraps(execute)
    def wrapper(self: BaseOperator, context: Context, *args: Any, **kwargs: Any) -> _R:
        try:
            return execute(self, context, *args, **kwargs)
        except S3StageError as exc:
            raise (AirflowFailException if exc.permanent else AirflowException)(str(exc)) from exc

    return wrapper


def airflow_error(exc: Exception, permanent: bool) -> AirflowException:
    """The Airflow exception for an error: permanent ones fail the task without retries."""
    return (AirflowFailException if permanent else AirflowException)(str(exc))


def _skipped(message: str) -> AirflowSkipException:
    return AirflowSkipException(
        f'the input holds no rows, so the task is skipped (InputSpec(on_empty="skip")): {message}'
    )


def input_error(exc: InputError, on_empty: str) -> AirflowException | None:
    """The Airflow exception for an input found wrong before the launch (all permanent: a retry sees
    the same input), or None when the job goes on: an input without rows that
    ``InputSpec(on_empty="commit")`` commits as 0 rows. ``"skip"`` skips the task."""
    if isinstance(exc, EmptyInputError) and on_empty == "commit":
        return None
    if isinstance(exc, EmptyInputError) and on_empty == "skip":
        return _skipped(str(exc))
    return AirflowFailException(str(exc))


def job_failed(outcome: Outcome, on_empty: str) -> AirflowException:
    """The Airflow exception for a job that did not succeed: permanent failures fail the task
    without retries; an input the job found without rows skips it under ``InputSpec(on_empty="skip")``
    (a query or a table snapshot of 0 rows, or Parquet files of 0 rows: only the job reads them)."""
    if on_empty == "skip" and outcome.failure is not None and outcome.failure.type == EmptyInputError.__name__:
        return _skipped(outcome.failure.error)
    return (AirflowFailException if outcome.permanent else AirflowException)(outcome.message)


def check_arguments(
    task_id: str | None,
    *,
    input: str | list[str] | None,
    sql: str | None,
    conn_id: str | None,
    input_spec: InputSpec | None,
    output_spec: OutputSpec,
    job_spec: JobSpec | None,
    materialize_chunk_rows: int,
    poll_interval: float,
    job_timeout: float | None,
    shard_column: str | None = None,
) -> None:
    """Raise SpecError for a combination no run can fix. Looks only at whether a templated
    argument is given (never at its value, which renders later)."""
    if (input is None) == (sql is None):
        raise SpecError(f"{task_id}: give exactly one of input=<Parquet path> or sql=<query> (with conn_id)")
    if sql is not None and not conn_id:
        raise SpecError(f"{task_id}: sql= needs conn_id=<an Airflow SQL connection id>")
    if not isinstance(output_spec, OutputSpec):
        raise SpecError(f"{task_id}: output_spec must be an OutputSpec, got {type(output_spec).__name__}")
    if input_spec is not None and not isinstance(input_spec, InputSpec):
        raise SpecError(f"{task_id}: input_spec must be an InputSpec, got {type(input_spec).__name__}")
    if job_spec is not None and not isinstance(job_spec, JobSpec):
        raise SpecError(f"{task_id}: job_spec must be a JobSpec, got {type(job_spec).__name__}")
    if shard_column is not None and sql is None:
        raise SpecError(f"{task_id}: shard_column= shards a sql= input; it has no meaning for input=")
    if materialize_chunk_rows < 1:
        raise SpecError("materialize_chunk_rows must be >= 1")
    if poll_interval <= 0:
        raise SpecError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
    if job_timeout is not None and job_timeout <= 0:
        raise SpecError(f"job_timeout must be > 0 seconds, got {job_timeout!r}")
    if job_spec is not None and job_spec.reuse:  # incremental scoring
        check_reuse(task_id, input_spec, output_spec)
    try:  # iceberg://<table>?snapshot_id=..&row_filter=.. (unless templated)
        check_table_input_argument(input)
    except ContractError as exc:
        raise SpecError(f"{task_id}: {exc}") from None
    if output_spec.mode is SaveMode.RESUME and (input_spec is None or not input_spec.id_column):
        raise SpecError(
            f"{task_id}: SaveMode.RESUME needs InputSpec(id_column=<a unique id column>) to know "
            "which rows an earlier attempt already scored"
        )


def check_reuse(task_id: str | None, input_spec: InputSpec | None, output_spec: OutputSpec) -> None:
    """``JobSpec(reuse=...)`` reuses rows of earlier runs under ``base_stage_location``: a fixed
    ``stage_location`` has none, and a file column's key would not see the file's content."""
    if not output_spec.base_stage_location:
        raise SpecError(
            f"{task_id}: JobSpec(reuse='unchanged') reuses rows of earlier runs under a base location; give "
            "OutputSpec(base_stage_location=...) instead of stage_location"
        )
    if input_spec is not None and input_spec.column_handling:
        raise SpecError(
            f"{task_id}: JobSpec(reuse='unchanged') cannot be combined with InputSpec.column_handling: a row's key "
            "covers the file location, not the file's content. Drop one of them"
        )
