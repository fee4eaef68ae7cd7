"""The ``ray_jobs`` launcher: the same runtime entrypoint, submitted to a Ray cluster's Jobs API.

The Airflow worker only submits and watches. Submission is idempotent: the ``submission_id`` is
derived from dag, task, run, map index and try, so a task that restarts while its job runs (a
worker crash, a triggerer hand-over) re-attaches instead of launching a second job, while a retry
(a new try) gets a new job. KubeRay and managed Ray are just other addresses of the same API.

Imports no Airflow: the trigger and the operator share it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class RayJobsError(RuntimeError):
    """The cluster could not be reached or refused a request; the message names the address."""


def submission_id_for(dag_id: str, task_id: str, run_id: str, map_index: int | None, try_number: int) -> str:
    """Stable across restarts of one try, distinct across tries, runs and mapped instances."""
    digest = hashlib.sha1(f"{dag_id}\x00{task_id}\x00{run_id}\x00{map_index}".encode()).hexdigest()[:12]
    readable = f"{_UNSAFE.sub('_', dag_id)[:40]}-{_UNSAFE.sub('_', task_id)[:40]}"
    return f"batchinfer-{readable}-{digest}-try{int(try_number)}"


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


@dataclass
class RayJobsLauncher:
    """Submit, watch, and stop runtime jobs through ``ray.job_submission.JobSubmissionClient``."""

    address: str
    headers: dict[str, str] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None
    python: str = "python"
    verify: bool | str = True
    submit_retry_s: float = 120.0

    def __post_init__(self) -> None:
        self._client = None

    @property
    def dashboard_url(self) -> str:
        return self.address.rstrip("/")

    def client(self):
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
        return f"{shlex.quote(self.python)} -m airflow_provider_batchinfer.runtime --spec {shlex.quote(spec_location)}"

    def find(self, submission_id: str) -> dict[str, Any] | None:
        """The job's info as a dict, or None when the cluster has no job with that id."""
        try:
            info = self.client().get_job_info(submission_id)
        except RuntimeError as exc:
            if "404" in str(exc) or "does not exist" in str(exc):
                return None
            raise RayJobsError(f"Ray Jobs API at {self.address} failed: {exc}") from exc
        return {"submission_id": submission_id, "status": str(info.status.value if hasattr(info.status, "value") else info.status),
                "message": info.message, "metadata": info.metadata or {}}

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
                return self.client().submit_job(
                    entrypoint=self.entrypoint(spec_location),
                    submission_id=submission_id,
                    runtime_env=self.runtime_env or None,
                    metadata=metadata or {},
                    entrypoint_num_cpus=entrypoint_num_cpus,
                    entrypoint_num_gpus=entrypoint_num_gpus,
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
                raise RayJobsError(f"submitting {submission_id} to the Ray Jobs API at {self.address} failed: {exc}") from exc

    def status(self, submission_id: str) -> str:
        status = self.client().get_job_status(submission_id)
        return str(status.value if hasattr(status, "value") else status)

    def logs(self, submission_id: str) -> str:
        return self.client().get_job_logs(submission_id)

    def stop(self, submission_id: str) -> bool:
        try:
            return bool(self.client().stop_job(submission_id))
        except Exception:  # stopping is best-effort: a job that already ended cannot be stopped
            return False

    def wait(
        self,
        submission_id: str,
        log_line: Callable[[str], None],
        poll_interval: float = 5.0,
        timeout: float | None = None,
    ) -> str:
        """Block until the job ends, forwarding new driver log lines; returns the final status.
        On ``timeout`` the job is stopped and ``"TIMEOUT"`` returned."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        while True:
            status = self.status(submission_id)
            text = self.logs(submission_id)
            fresh = text[seen:]
            complete = fresh if status in TERMINAL else fresh[: fresh.rfind("\n") + 1]
            for line in complete.splitlines():
                log_line(line)
            seen += len(complete)
            if status in TERMINAL:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                self.stop(submission_id)
                return "TIMEOUT"
            time.sleep(poll_interval)
