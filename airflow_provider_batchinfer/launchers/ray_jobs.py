"""The ``ray_jobs`` launcher: the same runtime entrypoint, submitted to a Ray cluster's Jobs API.

The Airflow worker only submits and watches. A job belongs to its task instance, not to a try: it
carries the task key and the job's identity (:mod:`airflow_provider_batchinfer.identity`) in its
metadata, and ``_job.json`` records its submission id and identity *before* it is submitted. A new
try (a lost worker, a restarted task) whose claim names a job of the same identity still running
re-attaches to it (:meth:`RayJobsLauncher.existing_job`); otherwise :meth:`~RayJobsLauncher.before_start`
stops every job of the task instance still running (an earlier try's, or one computing a changed
input or model) and a new one is submitted. Ray refuses a submission id it has seen before, even
for a job that ended, so each submission's id ends with its attempt id
(:func:`submission_id_for`). KubeRay and managed Ray are just other addresses of the same API.
Deferrable: :class:`RayJobTrigger` watches it and forwards its log as it grows.

Imports no Airflow: the trigger and the operator share it.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import last_failure
from airflow_provider_batchinfer.identity import task_key
from airflow_provider_batchinfer.launchers.base import (
    FAILED,
    RUNTIME_MODULE,
    SUCCEEDED,
    TERMINAL,
    TIMEOUT,
    ExistingJob,
    JobHandle,
    Launcher,
    LaunchError,
    LogLine,
    Outcome,
    TaskLog,
    failure_message,
)

if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger
    from ray.job_submission import JobSubmissionClient

    from airflow_provider_batchinfer.contract import JobFile, RunOwner
    from airflow_provider_batchinfer.hooks.service_config import ServiceConfig

__all__ = ["TERMINAL", "RayJobsError", "RayJobsLauncher", "submission_id_for"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class RayJobsError(LaunchError):
    """The cluster could not be reached or refused a request; the message names the address."""


#: job metadata keys (beside dag_id, task_id, run_id, map_index, try_number, attempt)
TASK_KEY = "batchinfer_task"
IDENTITY_KEY = "batchinfer_identity"


def submission_id_for(owner: RunOwner, attempt: str, identity: str | None = None) -> str:
    """``batchinfer-<dag>-<task>-<identity, 128 bits>-<attempt>``: readable, and distinct for every
    submission (the attempt id is unique; Ray never accepts a submission id twice). Without an
    identity the task key stands in. Re-attaching never derives it: it reads it from ``_job.json``."""
    readable = f"{_UNSAFE.sub('_', owner.dag_id)[:40]}-{_UNSAFE.sub('_', owner.task_id)[:40]}"
    key = (identity or task_key(owner))[:32]
    return f"batchinfer-{readable}-{key}-{_UNSAFE.sub('_', attempt)}"


def job_metadata(owner: RunOwner, attempt: str, identity: str | None) -> dict[str, str]:
    """What a submitted job carries, so a later try can find (and stop) its task's jobs."""
    return {
        "dag_id": owner.dag_id,
        "task_id": owner.task_id,
        "run_id": owner.run_id,
        "map_index": str(owner.map_index),
        "try_number": str(owner.try_number),
        "attempt": attempt,
        TASK_KEY: task_key(owner),
        IDENTITY_KEY: identity or "",
    }


def belongs_to(metadata: Mapping[str, str], owner: RunOwner) -> bool:
    """Whether a job's metadata names this task instance (jobs submitted before the task key was
    recorded: by dag, task, run and map index)."""
    if TASK_KEY in metadata:
        return metadata[TASK_KEY] == task_key(owner)
    return (metadata.get("dag_id"), metadata.get("task_id"), metadata.get("run_id")) == (
        owner.dag_id,
        owner.task_id,
        owner.run_id,
    ) and metadata.get("map_index", "-1") == str(owner.map_index)


@contextmanager
def _env_without(*names: str) -> Iterator[None]:
    """JobSubmissionClient prefers RAY_ADDRESS from the environment over the address it is given
    (Ray 2.60, ray.dashboard.utils.get_address_for_submission_client); on a worker that also runs
    local-launcher jobs that variable points at a GCS, not at the Jobs API we were configured with."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def new_log_lines(text: str, offset: int, final: bool) -> tuple[list[str], int]:
    """The complete lines of a job's log after ``offset`` (all of the rest when ``final``) and the
    offset after them: a line still being written is forwarded on a later look, whole."""
    fresh = text[offset:]
    complete = fresh if final else fresh[: fresh.rfind("\n") + 1]
    return complete.splitlines(), offset + len(complete)


def _status_text(status: Any) -> str:
    return str(status.value if hasattr(status, "value") else status)


class RayJobsLauncher(Launcher):
    """Submit, watch, and stop runtime jobs through ``ray.job_submission.JobSubmissionClient``."""

    name = "ray_jobs"
    deferrable = True

    def __init__(
        self,
        address: str,
        headers: Mapping[str, str] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        python: str = "python",
        verify: bool | str = True,
        submit_retry_s: float = 120.0,
        stop_wait_s: float = 60.0,
    ) -> None:
        self.address = address
        self.headers = dict(headers or {})
        self.runtime_env = dict(runtime_env) if runtime_env else None
        self.python = python
        self.verify = verify
        self.submit_retry_s = submit_retry_s
        self.stop_wait_s = stop_wait_s
        self._client: JobSubmissionClient | None = None

    @classmethod
    def from_config(cls, config: ServiceConfig) -> RayJobsLauncher:
        """The cluster token (extra ``ray_token``) goes into the request headers only; it never reaches
        the job file, the logs or XCom. S3 credentials reach the driver through its runtime_env."""
        from airflow_provider_batchinfer.s3 import credential_env

        runtime_env = dict(config.runtime_env or {})
        credentials = credential_env(dict(config.storage_options))
        if credentials:  # for the job driver and its workers, as for the local launcher
            runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **credentials}
        return cls(
            address=config.ray_address or "",
            headers=config.ray_headers,
            runtime_env=runtime_env or None,
            python=config.python,
        )

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
                with _env_without("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
                    self._client = JobSubmissionClient(self.address, headers=self.headers or None, verify=self.verify)
            except Exception as exc:
                raise RayJobsError(
                    f"cannot reach the Ray Jobs API at {self.address}: {type(exc).__name__}: {exc}. Check the "
                    "batchinfer connection's host (the dashboard address, e.g. http://ray-head:8265) and its token"
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
            raise RayJobsError(f"Ray Jobs API at {self.address} failed: {exc}") from exc
        return {
            "submission_id": submission_id,
            "status": _status_text(info.status),
            "message": info.message,
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
    ) -> str:
        """Submit the runtime. The driver itself does no compute, so by default it reserves no CPU:
        the actor pool's resources come from the JobSpec inside the job."""
        deadline = time.monotonic() + self.submit_retry_s
        delay = 1.0
        while True:
            try:
                return str(
                    self.client().submit_job(
                        entrypoint=self.entrypoint(spec_location),
                        submission_id=submission_id,
                        runtime_env=self.runtime_env or None,
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
                    f"submitting {submission_id} to the Ray Jobs API at {self.address} failed: {exc}"
                ) from exc

    def status(self, submission_id: str) -> str:
        return _status_text(self.client().get_job_status(submission_id))

    def logs(self, submission_id: str) -> str:
        return str(self.client().get_job_logs(submission_id))

    def jobs_of(self, owner: RunOwner) -> list[dict[str, Any]]:
        """Every job the cluster lists for this task instance (any try, any state), by its metadata."""
        try:
            listed = self.client().list_jobs()
        except Exception as exc:
            raise RayJobsError(f"listing the jobs of the Ray Jobs API at {self.address} failed: {exc}") from exc
        return [
            {"submission_id": j.submission_id, "status": _status_text(j.status), "metadata": dict(j.metadata or {})}
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
        stop each (of an earlier try, or computing another input or model) and wait until it ended."""
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
        self.submit(job_location, sid, metadata=job_metadata(job.airflow, job.attempt, job.identity))
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

    def trigger(self, handle: JobHandle, *, conn_id: str, poll_interval: float, deadline: float | None) -> BaseTrigger:
        from airflow_provider_batchinfer.triggers.ray_job import RayJobTrigger

        return RayJobTrigger(
            submission_id=handle.job_id,
            model_service_conn_id=conn_id,
            poll_interval=poll_interval,
            deadline=deadline,
            log_offset=handle.log_offset,
        )
