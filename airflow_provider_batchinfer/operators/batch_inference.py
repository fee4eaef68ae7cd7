"""BatchInferenceOperator: score a table with a registered model, into a per-run directory.

The flow is the commit protocol, in an order that never loses or half-commits data:

1. resolve and verify the model, resolve the input and the run directory (no side effects);
2. apply the save mode: ``ERROR`` refuses a non-empty directory before any work; ``OVERWRITE``
   removes ``_SUCCESS`` first, then the rest; a directory owned by another dag/task is refused;
3. materialize a SQL input to Parquet in chunks, write the job spec (``_job.json``) naming this
   attempt, launch the Ray runtime;
4. read back the ``_SUCCESS`` manifest the runtime committed and return its summary as XCom.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
from airflow_provider_batchinfer.launchers.local import LaunchError
from airflow_provider_batchinfer.launchers.ray_jobs import TERMINAL, RayJobsError, RayJobsLauncher, submission_id_for
from airflow_provider_batchinfer.links.ray_dashboard import XCOM_KEY as RAY_JOB_URL_KEY
from airflow_provider_batchinfer.links.ray_dashboard import RayJobLink
from airflow_provider_batchinfer.registry import RegistryError
from airflow_provider_batchinfer.inputs import InputError, list_input_files
from airflow_provider_batchinfer.runtime.job import ERROR_PREFIX, JOB_FORMAT
from airflow_provider_batchinfer.s3 import S3StageError, check_bucket, is_s3
from airflow_provider_batchinfer.specs import InputSpec, JobSpec, OutputSpec, SaveMode, SpecError
from airflow_provider_batchinfer.stage import (
    INPUT_DIR,
    JOB_SPEC_FILE,
    SUCCESS_MARKER,
    ManifestError,
    Stage,
    StageError,
    join,
    new_attempt_id,
    read_valid_manifest,
    sanitize_run_key,
)

if TYPE_CHECKING:
    from airflow.sdk import Context


def fail_on_s3_errors(execute: Callable[..., Any]) -> Callable[..., Any]:
    """S3 errors that no retry can fix (no such bucket, access denied, unreachable endpoint) fail the
    task without Airflow retries; others (transient ones that outlived pyarrow's own retries) leave
    the task to its retries. Either way the message names the bucket and key."""

    @functools.wraps(execute)
    def wrapper(self: Any, context: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return execute(self, context, *args, **kwargs)
        except S3StageError as exc:
            raise (AirflowFailException if exc.permanent else AirflowException)(str(exc)) from exc

    return wrapper


class BatchInferenceOperator(BaseOperator):
    """Run a registered model over every row of a table and commit the predictions with ``_SUCCESS``.

    :param model: registered model name. :param version: its version (immutable, pinned by sha256).
    :param input: Parquet file or directory (or a list of them); relative paths are under the
        connection's stage root. Or give ``sql`` with ``conn_id`` (any Airflow SQL connection):
        the query result is materialized to Parquet in chunks of ``materialize_chunk_rows`` rows.
    :param input_spec: columns, passthrough columns, mapping and model params.
    :param output_spec: ``stage_location`` or ``base_stage_location`` and the ``SaveMode``.
    :param job_spec: replicas, CPUs/GPUs per replica, batch size.
    :param model_service_conn_id: the ``batchinfer`` connection (absent: the embedded default).
    :param deferrable: with the ``ray_jobs`` launcher, submit and then wait in the triggerer instead
        of a worker slot. The ``local`` launcher runs the job inside the task, so it always waits
        in the worker.
    :param poll_interval: seconds between job status checks (``ray_jobs``).
    :param job_timeout: seconds the job may run; past it the job is stopped and the task fails.

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
    )
    template_fields_renderers = {"sql": "sql"}
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
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        poll_interval: float = 10.0,
        job_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("multiple_outputs", True)
        super().__init__(**kwargs)
        if (input is None) == (sql is None):
            raise SpecError(
                f"{kwargs.get('task_id')}: give exactly one of input=<Parquet path> or sql=<query> (with conn_id)"
            )
        if sql is not None and not conn_id:
            raise SpecError(f"{kwargs.get('task_id')}: sql= needs conn_id=<an Airflow SQL connection id>")
        if not isinstance(output_spec, OutputSpec):
            raise SpecError(f"{kwargs.get('task_id')}: output_spec must be an OutputSpec, got {type(output_spec).__name__}")
        if input_spec is not None and not isinstance(input_spec, InputSpec):
            raise SpecError(f"{kwargs.get('task_id')}: input_spec must be an InputSpec, got {type(input_spec).__name__}")
        if job_spec is not None and not isinstance(job_spec, JobSpec):
            raise SpecError(f"{kwargs.get('task_id')}: job_spec must be a JobSpec, got {type(job_spec).__name__}")
        if materialize_chunk_rows < 1:
            raise SpecError("materialize_chunk_rows must be >= 1")
        if poll_interval <= 0:
            raise SpecError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        if job_timeout is not None and job_timeout <= 0:
            raise SpecError(f"job_timeout must be > 0 seconds, got {job_timeout!r}")
        if output_spec.mode is SaveMode.RESUME and (input_spec is None or not input_spec.id_column):
            raise SpecError(
                f"{kwargs.get('task_id')}: SaveMode.RESUME needs InputSpec(id_column=<a unique id column>) to know "
                "which rows an earlier attempt already scored"
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
        self.job_spec = job_spec or JobSpec()
        self.model_service_conn_id = model_service_conn_id
        self.materialize_chunk_rows = materialize_chunk_rows
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.job_timeout = job_timeout
        self._launcher = None
        self._submission_id: str | None = None

    @cached_property
    def hook(self) -> ModelServiceHook:
        return ModelServiceHook(model_service_conn_id=self.model_service_conn_id)

    # --- resolution (no side effects) -----------------------------------------------------------------
    def resolve_run_directory(self, context: Context) -> str:
        """``stage_location`` as given, or ``<base>/<sanitized run_id>[/map-<i>]``: stable across tries
        of one run (so retries overwrite), distinct across runs, backfills and manual triggers."""
        spec = OutputSpec(stage_location=self.stage_location, base_stage_location=self.base_stage_location,
                          mode=self.save_mode)
        if spec.stage_location:
            return self.hook.resolve_location(spec.stage_location)
        ti = context["ti"]
        location = join(self.hook.resolve_location(spec.base_stage_location), sanitize_run_key(ti.run_id))
        map_index = getattr(ti, "map_index", -1)
        if map_index is not None and map_index >= 0:
            location = join(location, f"map-{map_index}")
        return location

    def _owner(self, context: Context) -> dict[str, Any]:
        ti = context["ti"]
        return {
            "dag_id": ti.dag_id,
            "task_id": ti.task_id,
            "run_id": ti.run_id,
            "try_number": ti.try_number,
            "map_index": getattr(ti, "map_index", -1),
        }

    # --- the flow ------------------------------------------------------------------------------------------
    @fail_on_s3_errors
    def execute(self, context: Context) -> dict[str, Any]:
        owner = self._owner(context)
        try:
            mv = self.hook.get_model(self.model, self.version)
        except RegistryError as exc:
            raise AirflowFailException(str(exc)) from exc
        location = self.resolve_run_directory(context)
        run_dir = self.hook.open_stage(location)
        if is_s3(location):
            check_bucket(run_dir.fs, location)
        self.log.info("Model %s/%s (%s, sha256 %s) -> run directory %s [%s]", mv.name, mv.version, mv.flavor,
                      mv.sha256[:12], location, self.save_mode.name)
        if self.hook.config.launcher == "ray_jobs":
            return self._execute_ray_job(context, owner, mv, run_dir)
        spec = self._prepare(owner, mv, run_dir)
        self._launcher = self.hook.get_launcher()
        try:
            self._launcher.run(run_dir.child(JOB_SPEC_FILE).location, self.log, extra_env=self.hook.runtime_env())
        except LaunchError as exc:
            # nothing is committed either way; a permanent cause (access denied) is not worth a retry
            raise (AirflowFailException if exc.permanent else AirflowException)(
                f"batch inference job {spec['job_id']} failed: {exc}") from exc
        finally:
            self._launcher = None
        return self._finalize(run_dir.location, spec["attempt"])

    def _prepare(self, owner: dict[str, Any], mv: Any, run_dir: Stage, **extra: Any) -> dict[str, Any]:
        """Everything before the launch: input check, save mode, the job spec, SQL materialization."""
        input_locations = None
        if self.input is not None:
            raw = [self.input] if isinstance(self.input, str) else list(self.input)
            input_locations = [self.hook.resolve_location(loc) for loc in raw]
            try:
                list_input_files(input_locations, self.hook.storage_options)
            except InputError as exc:
                raise AirflowFailException(str(exc)) from exc

        resume = self.save_mode is SaveMode.RESUME and self._resume_allowed(run_dir, owner, mv, input_locations)
        if resume:
            self._clear_for_resume(run_dir)
        else:
            self._apply_save_mode(run_dir, owner)
        attempt = new_attempt_id(owner["try_number"])
        if input_locations is None:
            input_locations = [run_dir.child(INPUT_DIR).location]
        job_id = f"batchinfer-{sanitize_run_key(owner['dag_id'])}-{sanitize_run_key(owner['task_id'])}-{attempt}"
        local = self.hook.config.launcher == "local"
        spec = {
            "format": JOB_FORMAT,
            "job_id": job_id,
            "attempt": attempt,
            "launcher": self.hook.config.launcher,
            "run_dir": run_dir.location,
            "input": {"locations": input_locations},
            "input_spec": self.input_spec.to_dict(),
            "job_spec": self.job_spec.to_dict(),
            "model": mv.to_dict(),
            "registry_root": self.hook.config.registry_root,
            "file_roots": self.hook.config.file_roots,  # InputSpec.column_handling reads only below these
            "llm_engine": self.hook.config.llm_engine,
            "airflow": owner,
            # a Jobs API driver finds its cluster by itself; only the local launcher attaches
            "ray": {"address": self.hook.config.ray_address if local else None},
            "storage_options": self.hook.runtime_storage_options(),  # no credentials: see runtime_env()
            "resume": resume,
            **extra,
        }
        # claim the directory before anything else is written into it, so a retry recognizes
        # whatever this attempt leaves behind as its own
        run_dir.child(JOB_SPEC_FILE).write_json(spec)
        self.log.info("Job %s: spec at %s", job_id, run_dir.child(JOB_SPEC_FILE).location)
        if self.sql is not None:
            self._materialize_sql(run_dir.child(INPUT_DIR))
        return spec

    # --- ray_jobs: submit (or re-attach), then wait in the worker or defer -------------------------
    def _execute_ray_job(self, context: Context, owner: dict[str, Any], mv: Any, run_dir: Stage) -> dict[str, Any]:
        launcher = self.hook.get_ray_jobs_launcher()
        submission_id = submission_id_for(owner["dag_id"], owner["task_id"], owner["run_id"], owner["map_index"],
                                          owner["try_number"])
        try:
            existing = launcher.find(submission_id)
            if existing is not None and run_dir.child(JOB_SPEC_FILE).exists():
                attempt = run_dir.child(JOB_SPEC_FILE).read_json()["attempt"]
                self.log.info("Re-attaching to Ray job %s (%s) instead of submitting it again", submission_id,
                              existing["status"])
            else:
                self._stop_earlier_tries(launcher, owner)
                spec = self._prepare(owner, mv, run_dir, submission_id=submission_id)
                attempt = spec["attempt"]
                launcher.submit(
                    run_dir.child(JOB_SPEC_FILE).location,
                    submission_id,
                    metadata={"dag_id": owner["dag_id"], "task_id": owner["task_id"], "run_id": owner["run_id"],
                              "try_number": str(owner["try_number"])},
                )
                self.log.info("Submitted Ray job %s", submission_id)
        except RayJobsError as exc:
            raise AirflowException(str(exc)) from exc
        url = f"{launcher.dashboard_url}/#/jobs/{submission_id}"
        self.log.info("Ray job %s: driver log with `ray job logs %s --address %s`, dashboard %s",
                      submission_id, submission_id, launcher.dashboard_url, url)
        context["ti"].xcom_push(key=RAY_JOB_URL_KEY, value=url)
        self._submission_id = submission_id
        status = launcher.status(submission_id)
        if status in TERMINAL:
            return self._finish_ray_job(launcher, submission_id, status, run_dir.location, attempt)
        if self.deferrable:
            from airflow_provider_batchinfer.triggers.ray_job import RayJobTrigger

            deadline = None if self.job_timeout is None else time.time() + self.job_timeout
            self.defer(
                trigger=RayJobTrigger(submission_id=submission_id, model_service_conn_id=self.model_service_conn_id,
                                      poll_interval=self.poll_interval, deadline=deadline),
                method_name="execute_complete",
                # a backstop only: the trigger's own deadline stops the job first
                timeout=None if self.job_timeout is None else self.job_timeout + 10 * self.poll_interval + 60,
            )
        status = launcher.wait(submission_id, lambda line: self.log.info("%s", line), self.poll_interval,
                               self.job_timeout)
        return self._finish_ray_job(launcher, submission_id, status, run_dir.location, attempt, streamed=True)

    def _stop_earlier_tries(self, launcher: RayJobsLauncher, owner: dict[str, Any]) -> None:
        """A retry must not race a job of an earlier try still writing into the same directory."""
        for earlier in range(1, int(owner["try_number"])):
            sid = submission_id_for(owner["dag_id"], owner["task_id"], owner["run_id"], owner["map_index"], earlier)
            info = launcher.find(sid)
            if info is not None and info["status"] not in TERMINAL:
                self.log.warning("Stopping Ray job %s of try %d, still %s", sid, earlier, info["status"])
                launcher.stop(sid)

    @fail_on_s3_errors
    def execute_complete(self, context: Context, event: dict[str, Any] | None = None, **_: Any) -> dict[str, Any]:
        if not event or "status" not in event or "submission_id" not in event:
            raise AirflowException(f"unexpected trigger event: {event!r}")
        launcher = self.hook.get_ray_jobs_launcher()
        if event["status"] == "ERROR":
            raise AirflowException(f"watching Ray job {event['submission_id']} failed: {event.get('message')}")
        # the run directory and its _job.json are the record of this attempt; nothing else has to
        # survive the trip through the triggerer
        location = self.resolve_run_directory(context)
        attempt = self.hook.open_stage(location).child(JOB_SPEC_FILE).read_json()["attempt"]
        return self._finish_ray_job(launcher, event["submission_id"], event["status"], location, attempt)

    def _finish_ray_job(self, launcher: RayJobsLauncher, submission_id: str, status: str, location: str,
                        attempt: str, streamed: bool = False) -> dict[str, Any]:
        logs = ""
        try:
            logs = launcher.logs(submission_id)
        except Exception as exc:  # the verdict does not depend on the log
            self.log.warning("Could not fetch the driver log of %s: %s", submission_id, exc)
        if not streamed:
            for line in logs.splitlines():
                self.log.info("%s", line)
        if status == "SUCCEEDED":
            return self._finalize(location, attempt)
        error = next((line[len(ERROR_PREFIX):] for line in reversed(logs.splitlines()) if line.startswith(ERROR_PREFIX)), None)
        permanent = False
        if error:
            import json

            parsed = json.loads(error)
            error, permanent = parsed["error"], bool(parsed.get("permanent"))
        if status == "TIMEOUT":
            raise AirflowException(f"Ray job {submission_id} ran past job_timeout={self.job_timeout}s and was stopped; "
                                   "nothing was committed")
        tail = "\n".join(logs.splitlines()[-20:])
        raise (AirflowFailException if permanent else AirflowException)(
            f"Ray job {submission_id} ended {status}: {error or 'no error line in the driver log; last lines:'}"
            + ("" if error else f"\n{tail}")
        )

    def _resume_allowed(self, run_dir: Stage, owner: dict[str, Any], mv: Any, input_locations: list[str] | None) -> bool:
        """RESUME keeps earlier parts only when they were written for this very result: the same
        dag/task/run/map index, the same model (sha256), the same input and id column. Otherwise the
        directory is handled as with OVERWRITE (and a foreign directory is refused there)."""
        job_file = run_dir.child(JOB_SPEC_FILE)
        if not job_file.exists():
            return False
        try:
            recorded = job_file.read_json()
        except ValueError:
            return False
        airflow = recorded.get("airflow", {})
        same = {
            "task and run": tuple(airflow.get(k) for k in ("dag_id", "task_id", "run_id", "map_index"))
            == tuple(owner[k] for k in ("dag_id", "task_id", "run_id", "map_index")),
            "model sha256": recorded.get("model", {}).get("sha256") == mv.sha256,
            "input": input_locations is None
            or recorded.get("input", {}).get("locations") == list(input_locations),
            "id column": recorded.get("input_spec", {}).get("id_column") == self.input_spec.id_column,
        }
        differs = [what for what, ok in same.items() if not ok]
        if differs:
            self.log.warning("SaveMode.RESUME: the earlier attempt in %s differs in %s; starting over as with "
                             "OVERWRITE", run_dir.location, ", ".join(differs))
            return False
        return True

    def _clear_for_resume(self, run_dir: Stage) -> None:
        """Keep the parts (the runtime decides which are complete); remove the marker first, so a
        stale one never sits beside new parts, and a materialized SQL input, which is re-queried."""
        marker = run_dir.child(SUCCESS_MARKER)
        if marker.exists():
            marker.delete()
        if self.sql is not None:
            run_dir.child(INPUT_DIR).delete()
        self.log.info("SaveMode.RESUME: keeping the parts of earlier attempts in %s; only the remaining rows "
                      "will be scored", run_dir.location)

    def _apply_save_mode(self, run_dir: Stage, owner: dict[str, Any]) -> None:
        files = run_dir.list_files()
        if not files:
            return
        names = [name for name, _ in files]
        sample = ", ".join(names[:5]) + (" …" if len(names) > 5 else "")
        job_file = run_dir.child(JOB_SPEC_FILE)
        recorded = None
        if job_file.exists():
            try:
                recorded = job_file.read_json().get("airflow", {})
            except ValueError:
                recorded = {}
        if recorded is not None and (recorded.get("dag_id"), recorded.get("task_id")) != (owner["dag_id"], owner["task_id"]):
            raise AirflowFailException(
                f"run directory {run_dir.location} belongs to {recorded.get('dag_id')}.{recorded.get('task_id')}, not "
                f"{owner['dag_id']}.{owner['task_id']}; two tasks must not share a run directory: give this task its "
                "own stage_location / base_stage_location"
            )
        retry_leftovers = (
            recorded is not None
            and SUCCESS_MARKER not in names
            and (recorded.get("run_id"), recorded.get("map_index")) == (owner["run_id"], owner["map_index"])
        )
        if self.save_mode is SaveMode.ERROR and not retry_leftovers:
            raise AirflowFailException(
                f"run directory {run_dir.location} is not empty ({len(files)} file(s): {sample}) and the save mode is "
                "SaveMode.ERROR; nothing was changed. Use OutputSpec(mode=SaveMode.OVERWRITE) to replace it (retries "
                "and backfill re-runs), or write to another location"
            )
        if retry_leftovers and self.save_mode is SaveMode.ERROR:
            self.log.info("Removing the uncommitted files of an earlier try (try %s) of this task and run",
                          recorded.get("try_number"))
        if recorded is None:
            raise AirflowFailException(
                f"run directory {run_dir.location} holds {len(files)} file(s) ({sample}) that no batchinfer task wrote "
                f"(no {JOB_SPEC_FILE}); refusing to delete them with SaveMode.OVERWRITE. Point the task at an empty "
                "location or remove them yourself"
            )
        removed = run_dir.clear_run_directory()
        what = "SaveMode.OVERWRITE" if self.save_mode is SaveMode.OVERWRITE else "retry clean-up"
        if SUCCESS_MARKER in names:
            self.log.info("%s: removed %s then %d other file(s) from %s", what, SUCCESS_MARKER, removed - 1,
                          run_dir.location)
        else:
            self.log.info("%s: removed %d file(s) (no %s) from %s", what, removed, SUCCESS_MARKER, run_dir.location)

    def _materialize_sql(self, target: Stage) -> str:
        """Stream a query's result into Parquet parts of ``materialize_chunk_rows`` rows (never the
        whole result in memory) through the connection's own DB-API hook."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from airflow.sdk import BaseHook

        db_hook = BaseHook.get_connection(self.conn_id).get_hook()
        if not hasattr(db_hook, "get_conn"):
            raise AirflowFailException(f"connection {self.conn_id!r} is not a SQL connection (its hook has no get_conn)")
        self.log.info("Materializing the query on %s into %s", self.conn_id, target.location)
        rows_total = 0
        part = 0
        schema = None
        with closing(db_hook.get_conn()) as conn, closing(conn.cursor()) as cursor:
            cursor.execute(self.sql)
            if cursor.description is None:
                raise AirflowFailException("the input query returned no result set; it must be a SELECT")
            names = [d[0] for d in cursor.description]
            while True:
                rows = cursor.fetchmany(self.materialize_chunk_rows)
                if not rows:
                    break
                columns = list(zip(*rows))
                try:
                    table = pa.table({n: pa.array(list(c)) for n, c in zip(names, columns)})
                    if schema is None:
                        schema = table.schema
                    elif not table.schema.equals(schema):
                        table = table.cast(schema)
                except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                    raise AirflowFailException(
                        f"the input query's rows {rows_total + 1}-{rows_total + len(rows)} have types that do not fit "
                        f"{schema}: {exc}; cast the columns in the query"
                    ) from exc
                out = target.child(f"part-{part:05d}.parquet")
                out.fs.create_dir(target.path, recursive=True)
                with out.fs.open_output_stream(out.path) as sink:
                    pq.write_table(table, sink, compression="zstd")
                rows_total += len(rows)
                part += 1
        if rows_total == 0:
            raise AirflowFailException(f"the input query on {self.conn_id!r} returned no rows; nothing to score")
        self.log.info("Materialized %d rows in %d part(s)", rows_total, part)
        return target.location

    def _finalize(self, location: str, attempt: str) -> dict[str, Any]:
        try:
            manifest = read_valid_manifest(location, self.hook.storage_options)
        except (ManifestError, StageError) as exc:
            raise AirflowException(f"the job ended but its output is not valid: {exc}") from exc
        if manifest is None:
            raise AirflowException(f"the job ended but {location}/{SUCCESS_MARKER} was not written; nothing is committed")
        if manifest["job"]["attempt"] != attempt:
            raise AirflowException(
                f"{location}/{SUCCESS_MARKER} was written by attempt {manifest['job']['attempt']}, not this attempt "
                f"({attempt}); another attempt owns the directory"
            )
        counts = manifest["counts"]
        self.log.info("Committed %s rows (%s input, %s dead-lettered) in %d file(s) at %s", counts["output_rows"],
                      counts["input_rows"], counts["error_rows"], len(manifest["files"]), location)
        return {
            "output_location": location,
            "manifest_location": join(location, SUCCESS_MARKER),
            "rows": counts["output_rows"],
            "input_rows": counts["input_rows"],
            "error_rows": counts["error_rows"],
            "files": [f["name"] for f in manifest["files"]],
            "error_files": [f["name"] for f in manifest.get("error_files") or []],
            "model": manifest["model"]["name"],
            "model_version": manifest["model"]["version"],
            "sha256": manifest["model"]["sha256"],
            "job_id": manifest["job"]["id"],
            "attempt": attempt,
        }

    def on_kill(self) -> None:
        if self._launcher is not None:
            self.log.info("Stopping the batch inference job")
            self._launcher.kill()
        if self._submission_id is not None:
            stopped = self.hook.get_ray_jobs_launcher().stop(self._submission_id)
            self.log.info("Stopped Ray job %s: %s", self._submission_id, stopped)

    # --- OpenLineage (called by apache-airflow-providers-openlineage when it is installed) ------------
    def get_openlineage_facets_on_start(self) -> Any:
        """Inputs, the model and (with a fixed ``stage_location``) the output, before the job runs."""
        from airflow_provider_batchinfer.lineage import operator_lineage

        return operator_lineage(self)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Inputs, the model and the run directory, with schemas and statistics from ``_SUCCESS``."""
        from airflow_provider_batchinfer.lineage import operator_lineage

        return operator_lineage(self, task_instance)

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        """What the task meant to read and write; nothing from a manifest (none of this try's)."""
        from airflow_provider_batchinfer.lineage import operator_lineage

        return operator_lineage(self, task_instance, committed=False)
