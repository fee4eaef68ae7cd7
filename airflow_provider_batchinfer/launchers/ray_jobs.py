"""The ``ray_jobs`` launcher: the same runtime entrypoint, submitted to a Ray cluster's Jobs API.

The Airflow worker only submits and watches. A job belongs to its task instance, not to a try: it
carries the task key and the job's identity (:mod:`airflow_provider_batchinfer.store.identity`) in its
metadata, and ``_job.json`` records its submission id and identity *before* it is submitted. A new
try (a lost worker, a restarted task) whose claim names a job of the same identity still running
re-attaches to it (:meth:`RayJobsLauncher.existing_job`); otherwise :meth:`~RayJobsLauncher.before_start`
stops every job of the task instance still running (an earlier try's, or one computing a changed
input or model) and a new one is submitted. Ray refuses a submission id it has seen before, even
for a job that ended, so each submission's id ends with its attempt id
(:func:`submission_id_for`). KubeRay and managed Ray are other addresses of the same API.
Deferrable: :class:`RayJobTrigger` watches it and forwards its log as it grows. Imports no Airflow.
Secrets never become job metadata (``launchers/job_env.py``): the ``runtime_env`` holds public
settings only; the S3 session of a job that reads or writes S3 (from STS, never the connection's
keys) and the Iceberg catalog's secrets travel in a one-job package (``delivery.py``). What the cluster says back (driver log
lines, statuses, errors) is scrubbed of every secret value this launcher knows.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import last_failure
from airflow_provider_batchinfer.launchers.base import (
    FAILED,
    RUNTIME_MODULE,
    SUCCEEDED,
    TERMINAL,
    TIMEOUT,
    ExistingJob,
    JobHandle,
    Launcher,
    LauncherConfig,
    LaunchError,
    LogLine,
    Outcome,
    TaskLog,
    failure_message,
)
from airflow_provider_batchinfer.launchers.job_env import JobEnv, job_env, needs_s3_session, secrets_package
from airflow_provider_batchinfer.launchers.ray_job_ids import (
    IDENTITY_KEY,
    TASK_KEY,
    belongs_to,
    env_without,
    job_metadata,
    new_log_lines,
    status_text,
    submission_id_for,
)
from airflow_provider_batchinfer.store.redact import scrub, uri_secrets
from airflow_provider_batchinfer.store.s3 import shipped_credentials

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

    from airflow_provider_batchinfer.contract import JobFile, RunOwner

__all__ = [
    "IDENTITY_KEY",
    "TASK_KEY",
    "TERMINAL",
    "RayJobsError",
    "RayJobsLauncher",
    "belongs_to",
    "job_metadata",
    "new_log_lines",
    "submission_id_for",
]


class RayJobsError(LaunchError):
    """The cluster could not be reached or refused a request; the message names the address."""


class RayJobsLauncher(Launcher):
    """Submit, watch, and stop runtime jobs through ``ray.job_submission.JobSubmissionClient``."""

    name = "ray_jobs"
    deferrable = True
    trigger_classpath = "airflow_provider_batchinfer.triggers.ray_job.RayJobTrigger"

    def __init__(
        self,
        address: str,
        headers: Mapping[str, str] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        python: str = "python",
        verify: bool | str = True,
        submit_retry_s: float = 120.0,
        stop_wait_s: float = 60.0,
        storage_options: Mapping[str, Any] | None = None,
        catalog_env: Mapping[str, str] | None = None,
    ) -> None:
        self.address = address
        self.headers = dict(headers or {})
        self.runtime_env = dict(runtime_env) if runtime_env else None
        self._storage_options = dict(storage_options or {})  # with the connection's keys: never shipped
        self._catalog_env = dict(catalog_env or {})
        self._job_env: JobEnv | None = None
        self._secrets = [
            *(str(self._storage_options.get(k) or "") for k in ("secret_key", "session_token")),
            *self._catalog_env.values(),
            *(v.split(" ", 1)[-1] for k, v in self.headers.items() if k.lower() == "authorization"),
        ]
        self.python = python
        self.verify = verify
        self.submit_retry_s = submit_retry_s
        self.stop_wait_s = stop_wait_s
        self._client: JobSubmissionClient | None = None

    @classmethod
    def from_config(cls, config: LauncherConfig) -> RayJobsLauncher:
        """The cluster token (extra ``ray_token``) goes into the request headers only; it never reaches
        the job file, the logs or XCom. The connection's S3 keys stay here: a job gets a session
        derived from them when it starts (:meth:`prepare_env`)."""
        return cls(
            address=config.ray_address or "",
            headers=config.ray_headers,
            runtime_env=config.runtime_env or None,
            python=config.python,
            storage_options=config.storage_options,
            catalog_env=config.runtime_secrets,
        )

    def scrub(self, text: str) -> str:
        """``text`` without any secret value this launcher knows (the connection's, the job's session)."""
        return scrub(text, self._secrets)

    def prepare_env(self, log: TaskLog) -> JobEnv:
        """The environment of the next job (``job_env.py``): its S3 session is derived here, once,
        before the run directory is claimed, so a store without STS refuses the job before any work.
        Only a job with a location on S3 (``job_locations``, set by the operator) gets a session:
        one that reads and writes local files only runs without asking STS and without any key.
        Raises RayJobsError (permanent unless STS said to try again) with what to configure instead."""
        from airflow_provider_batchinfer.launchers.job_session import JobSessionError

        uses_s3 = needs_s3_session(self.job_locations)
        try:
            env = job_env(self._storage_options, {**self._catalog_env, **self.job_secrets}, self.job_timeout, uses_s3)
        except JobSessionError as exc:
            raise RayJobsError(self.scrub(str(exc)), permanent=exc.permanent) from exc
        self._secrets.extend(env.secret.values())
        self._secrets.extend(part for url in self.job_secrets.values() for part in uri_secrets(url))
        if env.expires is not None:
            log.info(
                "S3 for the Ray job: a session derived through STS%s, valid until %s (the connection's keys stay here)",
                f" for role {self._storage_options['role_arn']}" if self._storage_options.get("role_arn") else "",
                env.expires.isoformat(),
            )
        elif not uses_s3 and shipped_credentials(self._storage_options):
            log.info(
                "S3 for the Ray job: none; it reads and writes no S3 location, so no session is derived "
                "through STS and no key is shipped"
            )
        self._job_env = env
        return env

    @classmethod
    def check_address(cls, address: str | None, conn_id: str) -> str:
        if not address:
            raise ValueError(
                f"connection {conn_id!r}: the ray_jobs launcher needs the Ray dashboard address in the host field, "
                "e.g. http://ray-head:8265"
            )
        return address if "://" in address else f"http://{address}"

    @property
    def dashboard_url(self) -> str:
        return self.address.rstrip("/")

    def client(self) -> JobSubmissionClient:
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            try:
                with env_without("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
                    self._client = JobSubmissionClient(self.address, headers=self.headers or None, verify=self.verify)
            except Exception as exc:
                raise RayJobsError(
                    f"cannot reach the Ray Jobs API at {self.address}: {type(exc).__name__}: {self.scrub(str(exc))}. "
                    "Check the batchinfer connection's host (the dashboard address, e.g. http://ray-head:8265) and its "
                    "token"
                ) from exc
        return self._client

    def entrypoint(self, spec_location: str) -> str:
        return f"{shlex.quote(self.python)} -m {RUNTIME_MODULE} --spec {shlex.quote(spec_location)}"

    # --- the Jobs API, by submission id ------------------------------------------------------------
    def find(self, submission_id: str) -> dict[str, Any] | None:
        """The job's info as a dict, or None when the cluster has no job with that id."""
        try:
            info = self.client().get_job_info(submission_id)
        except RuntimeError as exc:
            if "404" in str(exc) or "does not exist" in str(exc):
                return None
            raise RayJobsError(f"Ray Jobs API at {self.address} failed: {self.scrub(str(exc))}") from exc
        return {
            "submission_id": submission_id,
            "status": status_text(info.status),
            "message": self.scrub(info.message or ""),
            "metadata": info.metadata or {},
        }

    def submit(
        self,
        spec_location: str,
        submission_id: str,
        *,
        entrypoint_num_cpus: float = 0,
        entrypoint_num_gpus: float = 0,
        metadata: dict[str, str] | None = None,
        runtime_env: dict[str, Any] | None = None,
    ) -> str:
        """Submit the runtime (with ``runtime_env``, else the connection's). The driver itself does
        no compute, so by default it reserves no CPU: the actor pool's resources come from the
        JobSpec inside the job."""
        deadline = time.monotonic() + self.submit_retry_s
        delay = 1.0
        while True:
            try:
                return str(
                    self.client().submit_job(
                        entrypoint=self.entrypoint(spec_location),
                        submission_id=submission_id,
                        runtime_env=runtime_env or self.runtime_env or None,
                        metadata=metadata or {},
                        entrypoint_num_cpus=entrypoint_num_cpus,
                        entrypoint_num_gpus=entrypoint_num_gpus,
                    )
                )
            except RayJobsError:
                raise
            except Exception as exc:
                text = str(exc)
                if "already exists" in text:  # an earlier attempt of this call got through
                    return submission_id
                # a head whose dashboard agent is still starting (or restarting) says so; wait for it
                if "try again later" in text and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 10.0)
                    continue
                raise RayJobsError(
                    f"submitting {submission_id} to the Ray Jobs API at {self.address} failed: {self.scrub(text)}"
                ) from exc

    def status(self, submission_id: str) -> str:
        return status_text(self.client().get_job_status(submission_id))

    def logs(self, submission_id: str) -> str:
        """The driver's log, scrubbed: every line of it may reach the task log."""
        return self.scrub(str(self.client().get_job_logs(submission_id)))

    def jobs_of(self, owner: RunOwner) -> list[dict[str, Any]]:
        """Every job the cluster lists for this task instance (any try, any state), by its metadata."""
        try:
            listed = self.client().list_jobs()
        except Exception as exc:
            raise RayJobsError(
                f"listing the jobs of the Ray Jobs API at {self.address} failed: {self.scrub(str(exc))}"
            ) from exc
        return [
            {"submission_id": j.submission_id, "status": status_text(j.status), "metadata": dict(j.metadata or {})}
            for j in listed
            if j.submission_id and belongs_to(j.metadata or {}, owner)
        ]

    def stop_job(self, submission_id: str) -> bool:
        try:
            return bool(self.client().stop_job(submission_id))
        except Exception:  # stopping is best-effort: a job that already ended cannot be stopped
            return False

    # --- the launcher interface ------------------------------------------------------------------
    def job_name(self, owner: RunOwner, attempt: str | None = None, identity: str | None = None) -> str:
        return submission_id_for(owner, attempt or f"t{int(owner.try_number):02d}", identity)

    def existing_job(self, claim: JobFile) -> ExistingJob | None:
        """The claim's job while it is not terminal: a try whose worker died re-attaches to it (also
        when that worker died between recording the claim and the submit: then the cluster does not
        know the id, and a fresh job is submitted)."""
        if claim.launcher != self.name or not claim.submission_id:
            return None
        info = self.find(claim.submission_id)
        if info is None or info["status"] in TERMINAL:
            return None
        return ExistingJob(job_id=claim.submission_id, status=info["status"], attempt=claim.attempt)

    def attach(self, job_id: str, attempt: str, log: TaskLog) -> JobHandle:
        url = f"{self.dashboard_url}/#/jobs/{job_id}"
        log.info(
            "Ray job %s: driver log with `ray job logs %s --address %s`, dashboard %s",
            job_id,
            job_id,
            self.dashboard_url,
            url,
        )
        return JobHandle(job_id=job_id, attempt=attempt, url=url)

    def before_start(self, owner: RunOwner, log: TaskLog, identity: str | None = None) -> None:
        """A new job must not race one of the same task instance still writing into its directory:
        stop each (of an earlier try, or computing another input or model) and wait until it ended.
        First, the new job's environment is prepared (:meth:`prepare_env`): a job that cannot get
        its S3 session stops nothing."""
        self.prepare_env(log)
        running = [j for j in self.jobs_of(owner) if j["status"] not in TERMINAL]
        for job in running:
            other = job["metadata"].get(IDENTITY_KEY)
            why = (
                "it computes another input, model or specs"
                if other and other != identity
                else "it is not re-attachable"
            )
            log.warning(
                "Stopping Ray job %s (try %s, %s) of this task instance: %s",
                job["submission_id"],
                job["metadata"].get("try_number", "?"),
                job["status"],
                why,
            )
            self.stop_job(job["submission_id"])
        deadline = time.monotonic() + self.stop_wait_s
        for job in running:
            while time.monotonic() < deadline:
                info = self.find(job["submission_id"])
                if info is None or info["status"] in TERMINAL:
                    break
                time.sleep(0.5)
            else:
                log.warning(
                    "Ray job %s did not stop within %.0fs; its attempt is fenced",
                    job["submission_id"],
                    self.stop_wait_s,
                )

    def start(self, job: JobFile, job_location: str, log: TaskLog) -> JobHandle:
        sid = job.submission_id or self.job_name(job.airflow, job.attempt, job.identity)
        env = self._job_env or self.prepare_env(log)
        self._job_env = None  # one session per job
        with secrets_package(env) as package:
            runtime_env = env.runtime_env(self.runtime_env, package)
            self.submit(
                job_location,
                sid,
                metadata=job_metadata(job.airflow, job.attempt, job.identity),
                runtime_env=runtime_env or None,
            )
        log.info("Submitted Ray job %s", sid)
        return self.attach(sid, job.attempt, log)

    def poll(self, handle: JobHandle) -> str | None:
        status = self.status(handle.job_id)
        return status if status in TERMINAL else None

    def wait(
        self, handle: JobHandle, log_line: LogLine, *, poll_interval: float = 5.0, timeout: float | None = None
    ) -> Outcome:
        """Block until the job ends, forwarding new driver log lines. On ``timeout`` the job is stopped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = handle.log_offset
        while True:
            status = self.status(handle.job_id)
            lines, seen = new_log_lines(self.logs(handle.job_id), seen, status in TERMINAL)
            for line in lines:
                log_line(line)
            if status in TERMINAL:
                return self.outcome(handle, status)
            if deadline is not None and time.monotonic() >= deadline:
                self.stop_job(handle.job_id)
                return self.outcome(handle, TIMEOUT, timeout=timeout)
            time.sleep(poll_interval)

    def outcome(
        self, handle: JobHandle, status: str, log_line: LogLine | None = None, *, timeout: float | None = None
    ) -> Outcome:
        if status == TIMEOUT:
            limit = "" if timeout is None else f"={timeout}"
            return Outcome(
                TIMEOUT,
                None,
                f"Ray job {handle.job_id} ran past job_timeout{limit}s and was stopped; nothing was committed",
            )
        logs = ""
        try:
            logs = self.logs(handle.job_id)
        except Exception as exc:  # the verdict does not depend on the log
            if log_line is not None:
                log_line(f"Could not fetch the driver log of {handle.job_id}: {exc}")
        if log_line is not None:  # what a trigger already logged is not logged again
            for line in logs[handle.log_offset :].splitlines():
                log_line(line)
        if status == SUCCEEDED:
            return Outcome(SUCCEEDED)
        failure = last_failure(logs)
        tail = "\n".join(logs.splitlines()[-20:])
        return Outcome(
            status if status in TERMINAL else FAILED,
            failure,
            failure_message(f"Ray job {handle.job_id}", status, failure, tail),
        )

    def stop(self, handle: JobHandle) -> bool:
        return self.stop_job(handle.job_id)

    def trigger_kwargs(self, handle: JobHandle) -> dict[str, Any]:
        return {"submission_id": handle.job_id, "log_offset": handle.log_offset}
