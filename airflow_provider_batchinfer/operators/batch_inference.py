"""BatchInferenceOperator: score a table with a registered model, into a per-run directory.

The flow, the same for every launcher, is the commit protocol in an order that never loses or
half-commits data:

1. **resolve** the model (verified by sha256), the input and the run directory (no side effects);
2. **prepare** the run directory (``rundir.prepare``: the save mode, RESUME, ownership), claim it
   with the job file (``_job.json``) naming this attempt (a table input is pinned to its
   snapshot; a SQL input's query is read by the job, the worker only resolves its connection);
3. **launch** the runtime through the connection's launcher, or re-attach to this try's job;
4. **wait** in the worker, forwarding the job's log, or **defer** to the launcher's trigger;
5. **finalize**: read back the ``_SUCCESS`` manifest the runtime committed, return its summary.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from airflow.sdk import BaseOperator
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException

from airflow_provider_batchinfer.contract import (
    JOB_SPEC_FILE,
    ContractError,
    JobFile,
    RunOwner,
    new_attempt_id,
)
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec
from airflow_provider_batchinfer.contract.specs.tables import is_table_input
from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
from airflow_provider_batchinfer.launchers.base import LaunchError
from airflow_provider_batchinfer.launchers.job_env import job_locations
from airflow_provider_batchinfer.links.ray_dashboard import XCOM_KEY as RAY_JOB_URL_KEY
from airflow_provider_batchinfer.links.ray_dashboard import RayJobLink
from airflow_provider_batchinfer.operators import assets, table_io
from airflow_provider_batchinfer.operators.build_job import (
    bind_sql,
    build_job_file,
    input_locations_of,
    sql_job_secrets,
)
from airflow_provider_batchinfer.operators.errors import (
    airflow_error,
    check_arguments,
    fail_on_s3_errors,
    job_failed,
)
from airflow_provider_batchinfer.operators.finalize import committed_result
from airflow_provider_batchinfer.operators.lineage import OpenLineageMethods
from airflow_provider_batchinfer.operators.runs import claim_for_reattach, resolve, run_directory, run_owner
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.identity import input_fingerprint, job_identity, result_identity
from airflow_provider_batchinfer.store.stage import Stage
from airflow_provider_batchinfer.triggers.base import WatchStatus, event_log_offset, job_trigger, validate_event

if TYPE_CHECKING:
    from airflow.sdk import Asset, Context

    from airflow_provider_batchinfer.launchers.base import JobHandle, Launcher, Outcome
    from airflow_provider_batchinfer.registry import ModelVersion


class BatchInferenceOperator(OpenLineageMethods, BaseOperator):
    """Run a registered model over every row of a table and commit the predictions with ``_SUCCESS``.

    :param model: registered model name. :param version: its version (immutable, pinned by sha256).
    :param input: Parquet file or directory (or a list of them); relative paths are under the
        connection's stage root. Or give ``sql`` with ``conn_id`` (any Airflow SQL connection):
        the job reads the query (never the Airflow worker) into Parquet under the run directory's
        ``_input/<attempt>/``: in shards on Ray when ``shard_column`` names a column the database
        can hash with ``shard_hash_fn`` (``ray.data.read_sql``), else streamed by its driver in
        chunks of ``materialize_chunk_rows`` rows.
    :param input_spec: columns, passthrough columns, mapping and model params.
    :param output_spec: ``stage_location`` or ``base_stage_location`` and the ``SaveMode``.
    :param job_spec: replicas, CPUs/GPUs per replica, batch size.
    :param model_service_conn_id: the ``batchinfer`` connection (absent: the embedded default).
    :param deferrable: with a launcher that can defer (``ray_jobs``), start the job and then wait in
        the triggerer instead of a worker slot. The ``local`` launcher runs the job inside the task,
        so it always waits in the worker.
    :param poll_interval: seconds between job status checks (``ray_jobs``).
    :param job_timeout: seconds the job may run; past it the job is stopped and the task fails.
    :param output_asset: the Asset whose event announces each commit (``docs/usage.md``): ``True``
        (default) names it after the output location (``operators.assets.stage_asset``), or give an
        ``Asset`` / asset name; ``False`` emits none.

    Returns (and pushes as separate XCom keys) ``output_location``, ``manifest_location``,
    ``rows``, ``input_rows``, ``error_rows``, ``files``, ``model``, ``model_version``, ``sha256``,
    ``job_id`` and ``attempt``.
    """

    template_fields: Sequence[str] = (
        "model",
        "version",
        "input",
        "sql",
        "conn_id",
        "stage_location",
        "base_stage_location",
        "model_service_conn_id",
        "table",
    )
    template_ext: Sequence[str] = (".sql",)
    template_fields_renderers: ClassVar[dict[str, str]] = {"sql": "sql"}
    ui_color = "#e8d9ff"
    operator_extra_links = (RayJobLink(),)

    def __init__(
        self,
        *,
        model: str,
        version: str,
        input: str | list[str] | None = None,
        sql: str | None = None,
        conn_id: str | None = None,
        input_spec: InputSpec | None = None,
        output_spec: OutputSpec,
        job_spec: JobSpec | None = None,
        model_service_conn_id: str = ModelServiceHook.default_conn_name,
        materialize_chunk_rows: int = 100_000,
        shard_column: str | None = None,
        shard_hash_fn: str = "MD5",
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        poll_interval: float = 10.0,
        job_timeout: float | None = None,
        output_asset: Asset | str | bool | None = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("multiple_outputs", True)
        super().__init__(**kwargs)
        check_arguments(
            kwargs.get("task_id"),
            input=input,
            sql=sql,
            conn_id=conn_id,
            input_spec=input_spec,
            output_spec=output_spec,
            job_spec=job_spec,
            materialize_chunk_rows=materialize_chunk_rows,
            shard_column=shard_column,
            poll_interval=poll_interval,
            job_timeout=job_timeout,
        )
        self.model = model
        self.version = version
        self.input = input
        self.sql = sql
        self.conn_id = conn_id
        self.input_spec = input_spec or InputSpec()
        # copied out of the frozen OutputSpec so Airflow can render templates in them
        self.stage_location = output_spec.stage_location
        self.base_stage_location = output_spec.base_stage_location
        self.save_mode = output_spec.mode
        self.table = output_spec.table  # an Iceberg table (operators/table_io.py)
        self.job_spec = job_spec or JobSpec()
        self.model_service_conn_id = model_service_conn_id
        self.materialize_chunk_rows = materialize_chunk_rows
        self.shard_column = shard_column
        self.shard_hash_fn = shard_hash_fn
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.job_timeout = job_timeout
        self._launcher: Launcher | None = None
        self._handle: JobHandle | None = None
        # an outlet Asset whose event carries the committed run's summary (operators/assets.py)
        self.output_asset = assets.attach_output_asset(self, output_spec, output_asset, model_service_conn_id)

    @cached_property
    def hook(self) -> ModelServiceHook:
        return ModelServiceHook(model_service_conn_id=self.model_service_conn_id)

    def _tables(self) -> table_io.TableSteps:
        """The table side of this task, from its rendered fields."""
        return table_io.TableSteps(self.hook, self.table, self.save_mode, self.input, self.base_stage_location)

    # --- resolve (no side effects) --------------------------------------------------------------------
    def resolve_run_directory(self, context: Context) -> str:
        """``stage_location`` as given, or ``<base>/<sanitized run_id>[/map-<i>]``: stable across tries
        of one run (so retries overwrite), distinct across runs, backfills and manual triggers."""
        if self.table:
            return self._tables().claim_directory(context["ti"])
        return run_directory(self.hook, self.stage_location, self.base_stage_location, context["ti"])

    # --- the flow --------------------------------------------------------------------------------------
    @assets.emits_asset_event
    @fail_on_s3_errors
    def execute(self, context: Context) -> dict[str, Any]:
        owner = run_owner(context["ti"])
        self.hook.check_credential_lifetime(self.job_timeout)
        location = self.resolve_run_directory(context)
        mv, run_dir = resolve(self.hook, self.model, self.version, location, self.save_mode.name, self.log)
        launcher = self._launcher = self.hook.get_launcher()
        launcher.job_timeout = self.job_timeout  # what a job's derived S3 session is bounded by
        # a SQL input: the job connects to the database itself (operators/build_job.py)
        launcher.job_secrets = sql_job_secrets(self.conn_id) if self.sql is not None and self.conn_id else {}
        try:
            handle = self._handle = self._launch(launcher, owner, mv, run_dir)
            if handle.url:
                context["ti"].xcom_push(key=RAY_JOB_URL_KEY, value=handle.url)
            status = launcher.poll(handle)
            if status is not None:
                outcome = launcher.outcome(handle, status, self._log_line, timeout=self.job_timeout)
            elif self.deferrable and launcher.deferrable:
                self._defer(launcher, handle)
            else:
                outcome = launcher.wait(
                    handle, self._log_line, poll_interval=self.poll_interval, timeout=self.job_timeout
                )
        except LaunchError as exc:
            raise airflow_error(exc, exc.permanent) from exc
        finally:
            self._launcher = None
        return self._finish(outcome, run_dir.location, handle.attempt)

    def _launch(self, launcher: Launcher, owner: RunOwner, mv: ModelVersion, run_dir: Stage) -> JobHandle:
        """Re-attach to the job the run directory's claim names when it has this job's identity and
        the launcher still sees it running (a try whose worker died: the run directory and its
        ``_job.json`` stay as they are, the job fences on the attempt recorded there); else clear
        the way, prepare the run directory and start a new job."""
        input_locations = input_locations_of(self.hook, self.input, self.input_spec.on_empty)
        result = result_identity(
            input_fingerprint=input_fingerprint(  # an iceberg:// input counts by its URI (its snapshot is pinned)
                input_locations, self.sql or str(self.input), self.conn_id, self.hook.storage_options
            ),
            model_sha256=mv.sha256,
            input_spec=self.input_spec,
            job_spec=self.job_spec,
            model_flavor=mv.flavor,
            model_signature=mv.signature,
            connection_engine=self.hook.config.llm_engine,
        )
        identity = job_identity(
            owner,
            run_dir=run_dir.location,
            result=result,
            model=f"{mv.name}/{mv.version}",
            input_spec=self.input_spec,
            job_spec=self.job_spec,
            save_mode=self.save_mode,
        )
        claim = claim_for_reattach(run_dir, self.log)
        if claim is not None and claim.identity == identity:
            existing = launcher.existing_job(claim)
            if existing is not None:
                self.log.info(
                    "Re-attaching to job %s (%s, attempt %s of try %d) instead of starting it again",
                    existing.job_id,
                    existing.status,
                    existing.attempt,
                    claim.airflow.try_number,
                )
                return launcher.attach(existing.job_id, existing.attempt, self.log)
        catalog = self.hook.catalog_properties() if self.table or is_table_input(self.input) else None
        roots = self.hook.config.file_roots  # what a ray_jobs job's S3 session depends on (launchers/job_env.py)
        launcher.job_locations = job_locations(run_dir.location, mv.uri, roots, input_locations, catalog)
        launcher.before_start(owner, self.log, identity)
        job = self._prepare(launcher, owner, mv, run_dir, input_locations, identity, result)
        return launcher.start(job, run_dir.child(JOB_SPEC_FILE).location, self.log)

    def _prepare(
        self,
        launcher: Launcher,
        owner: RunOwner,
        mv: ModelVersion,
        run_dir: Stage,
        input_locations: list[str] | None,
        identity: str,
        result: dict[str, str],
    ) -> JobFile:
        """Everything before the launch: save mode, the job file (with the table or query it reads)."""
        tables = self._tables()
        pinned = tables.pinned_input(run_dir)  # read before the claim is cleared
        if tables.table is None:  # asked before the save mode deletes anything: see rundir.require_fenced_store
            rundir.require_fenced_store(run_dir, new_attempt_id(owner.try_number))
        try:
            prep = rundir.prepare(
                run_dir,
                owner,
                tables.claim_mode(run_dir),  # ERROR on a table is checked against the table
                result=result,
                materialized_input=self.sql is not None or is_table_input(self.input),
                requeried_input=self.sql is not None,
            )
        except rundir.RunDirectoryError as exc:
            raise airflow_error(exc, exc.permanent) from exc
        for message in prep.messages:
            self.log.info("%s", message)
        job = build_job_file(
            self.hook,
            self.input_spec,
            self.job_spec,
            launcher,
            owner,
            mv,
            run_dir,
            input_locations,
            prep.resume,
            identity,
        )
        # what decided these rows (a RESUME compares it) and whose parts a RESUME may keep
        job = dataclasses.replace(job, result=result, resumable=prep.lineage(job.attempt))
        job = tables.bind(job, run_dir, pinned)  # table input snapshot, table output
        if self.sql is not None and self.conn_id:  # the query, read by the job itself
            job = bind_sql(
                job,
                self.sql,
                self.conn_id,
                self.materialize_chunk_rows,
                self.shard_column,
                self.shard_hash_fn,
                prep.input_digest,
            )
        # claimed before anything else is written into it (so a retry recognizes whatever this
        # attempt leaves behind as its own) and before the submit (so a retry finds the job even
        # when this worker dies right after submitting it)
        rundir.claim(run_dir, job)
        self.log.info("Job %s: spec at %s", job.job_id, run_dir.child(JOB_SPEC_FILE).location)
        tables.log_input(job, self.log)  # its rows are read by the job (runtime/inputs/table_input.py)
        if job.sql_input is not None:
            self.log.info(
                "Input: the query on %s, read by the job (runtime/inputs/sql_input.py)", job.sql_input.conn_id
            )
        return job

    def _defer(self, launcher: Launcher, handle: JobHandle) -> NoReturn:
        deadline = None if self.job_timeout is None else time.time() + self.job_timeout
        self.defer(
            trigger=job_trigger(
                launcher,
                handle,
                conn_id=self.model_service_conn_id,
                poll_interval=self.poll_interval,
                deadline=deadline,
            ),
            method_name="execute_complete",
            # a backstop only: the trigger's own deadline stops the job first
            timeout=None if self.job_timeout is None else self.job_timeout + 10 * self.poll_interval + 60,
        )

    @assets.emits_asset_event
    @fail_on_s3_errors
    def execute_complete(self, context: Context, event: dict[str, Any] | None = None, **_: Any) -> dict[str, Any]:
        event = validate_event(event, "job_id", "job_status")
        if event["status"] == WatchStatus.ERROR.value:
            raise AirflowException(f"watching job {event['job_id']} failed: {event.get('message')}")
        # the run directory and its _job.json are the record of this attempt; nothing else has to
        # survive the trip through the triggerer
        location = self.resolve_run_directory(context)
        try:
            claim = rundir.read_claim(self.hook.open_stage(location))
        except ContractError as exc:
            raise AirflowException(str(exc)) from exc
        if claim is None:
            raise AirflowException(
                f"{location}/{JOB_SPEC_FILE} is gone: the run directory was changed while job "
                f"{event['job_id']} ran; nothing is committed"
            )
        launcher = self.hook.get_launcher()
        try:
            handle = launcher.attach(str(event["job_id"]), claim.attempt, self.log)
            # the trigger logged the job's log up to here as it ran: forward only the rest
            handle = dataclasses.replace(handle, log_offset=event_log_offset(event))
            outcome = launcher.outcome(handle, str(event["job_status"]), self._log_line, timeout=self.job_timeout)
        except LaunchError as exc:
            raise airflow_error(exc, exc.permanent) from exc
        return self._finish(outcome, location, claim.attempt)

    # --- finalize ----------------------------------------------------------------------------------------
    def _log_line(self, line: str) -> None:
        self.log.info("%s", line)

    def _finish(self, outcome: Outcome, location: str, attempt: str) -> dict[str, Any]:
        if not outcome.succeeded:
            raise job_failed(outcome, self.input_spec.on_empty)
        return self._finalize(location, attempt)

    def _finalize(self, location: str, attempt: str) -> dict[str, Any]:
        location, options = self._tables().result_source(location)  # iceberg://<table>/<run key>
        return committed_result(location, attempt, options, self.log)

    def on_kill(self) -> None:
        launcher, handle = self._launcher, self._handle
        if launcher is None and handle is not None:  # e.g. killed while deferred: a fresh client stops it
            launcher = self.hook.get_launcher()
        if launcher is not None and handle is not None:
            stopped = launcher.stop(handle)
            self.log.info("Stopped job %s: %s", handle.job_id, stopped)
