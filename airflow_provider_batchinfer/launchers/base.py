"""One interface for every way of running the runtime entrypoint.

The operator's flow is the same for all of them::

    existing_job(claim) -> attach(...)      the run directory's claim names a job of the same identity
                                            (task instance + what it computes) that still runs: re-attach
      or before_start(owner) -> start(job)  else clear the way (stop the task's other running jobs), start
    poll(handle)                            ended already?  -> outcome(handle, status)
    trigger(handle, ...)                    deferrable: the triggerer watches -> outcome(handle, status)
    wait(handle, ...)                       or wait in the worker, forwarding the job's log lines
    stop(handle)                            on_kill

A launcher knows its backend's vocabulary; what it hands back is an :class:`Outcome`: succeeded, or
failed with the runtime's :class:`~airflow_provider_batchinfer.contract.JobFailure` (read with
``contract.parse_runtime_line`` / ``last_failure``) and whether a retry can help. Imports neither
Airflow nor Ray (a deferrable launcher imports its trigger inside :meth:`Launcher.trigger`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from airflow_provider_batchinfer.contract import JobFailure

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract import JobFile, RunOwner

#: terminal job states every launcher reports in (Ray's own names, plus TIMEOUT for a job stopped
#: because it ran past ``job_timeout``)
SUCCEEDED = "SUCCEEDED"
FAILED = "FAILED"
STOPPED = "STOPPED"
TIMEOUT = "TIMEOUT"
TERMINAL = (SUCCEEDED, FAILED, STOPPED)

LogLine = Callable[[str], None]

#: what every launcher runs, as ``python -m RUNTIME_MODULE --spec <job file>`` (never imported here)
RUNTIME_MODULE = "airflow_provider_batchinfer.runtime"


class TaskLog(Protocol):
    """What a launcher writes to: the task's logger (``logging.Logger`` or Airflow's)."""

    def info(self, msg: str, /, *args: Any) -> object: ...

    def warning(self, msg: str, /, *args: Any) -> object: ...

    def error(self, msg: str, /, *args: Any) -> object: ...


class LaunchError(RuntimeError):
    """The job could not be started or watched (not: the job failed, see :class:`Outcome`).
    ``permanent``: no retry can fix it (e.g. the cluster runs another Ray version)."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class JobHandle:
    """A started (or re-attached) job: the launcher's id for it, the attempt its ``_job.json``
    names, and where a user can watch it (None when nowhere but the task log). ``log_offset``: how
    much of the job's log was already forwarded to the task log (e.g. by a trigger), so
    :meth:`Launcher.outcome` and :meth:`Launcher.wait` forward only the rest."""

    job_id: str
    attempt: str
    url: str | None = None
    log_offset: int = 0


@dataclass(frozen=True)
class ExistingJob:
    """A job that a claim (``_job.json``) names and the launcher still sees running: a new try
    of the same identity re-attaches to it under the claim's ``attempt``."""

    job_id: str
    status: str
    attempt: str


@dataclass(frozen=True)
class Outcome:
    """How a job ended. ``message`` is the task's error message when it did not succeed: it names
    the job and quotes the runtime's own error (or the log's last lines when there was none)."""

    status: str
    failure: JobFailure | None = None
    message: str = ""

    @property
    def succeeded(self) -> bool:
        return self.status == SUCCEEDED

    @property
    def permanent(self) -> bool:
        """No retry can help: the runtime said so (a timeout or a stop never is)."""
        return self.failure is not None and self.failure.permanent


class LauncherConfig(Protocol):
    """What a launcher reads from the connection: the hook's ``ServiceConfig`` has it. Launchers sit
    below hooks, so they name what they need here instead of importing the hook's config."""

    @property
    def ray_address(self) -> str | None: ...
    @property
    def runtime_env(self) -> dict[str, Any] | None: ...
    @property
    def python(self) -> str: ...
    @property
    def local_ray_idle_s(self) -> float | None: ...
    @property
    def storage_options(self) -> Mapping[str, Any]: ...
    @property
    def ray_headers(self) -> Mapping[str, str]: ...
    @property
    def runtime_secrets(self) -> Mapping[str, str]: ...


class Launcher(abc.ABC):
    """Base of every launcher. Subclasses set ``name`` (the connection's ``launcher`` value) and,
    when a trigger can watch their jobs from the triggerer, ``deferrable``, ``trigger_classpath``
    and :meth:`trigger_kwargs`."""

    name: ClassVar[str]
    deferrable: ClassVar[bool] = False
    #: the trigger that watches this launcher's jobs, by classpath as Airflow serializes triggers:
    #: launchers sit below triggers and never import them (``triggers.base.job_trigger`` builds it)
    trigger_classpath: ClassVar[str | None] = None
    #: seconds the next job may run (the operator's ``job_timeout``; None: unbounded): what a
    #: launcher that derives a session for the job bounds it by
    job_timeout: float | None = None
    #: secret variables for the next job only (a SQL input's database URL): delivered as the
    #: launcher delivers its storage credentials, never as job metadata
    job_secrets: Mapping[str, str] = MappingProxyType({})
    #: every place the next job may read or write (``job_env.job_locations``); None: not known. A
    #: launcher that derives an S3 session for the job derives one only when a location is on S3
    job_locations: tuple[str, ...] | None = None

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: LauncherConfig) -> Launcher:
        """The launcher a parsed connection describes."""

    @classmethod
    def check_address(cls, address: str | None, conn_id: str) -> str | None:
        """Validate and normalize the connection's address for this launcher (ValueError if unusable)."""
        return address

    # --- identity --------------------------------------------------------------------------------
    def job_name(self, owner: RunOwner, attempt: str | None = None, identity: str | None = None) -> str | None:
        """The id this launcher will give the job of this attempt, known before the start (recorded
        with the identity as ``JobFile.submission_id`` before anything is submitted, so a crash
        between submit and record is recovered); None when the launcher has no such id."""
        return None

    @property
    def job_ray_address(self) -> str | None:
        """The Ray address the job file carries (``JobFile.ray_address``): where the runtime attaches."""
        return None

    def existing_job(self, claim: JobFile) -> ExistingJob | None:
        """The job ``claim`` names (its ``submission_id``), when this launcher still sees it running.
        The operator asks only when the claim's identity is the new try's: a retry after a lost
        worker re-attaches instead of starting the work again. Default: none can be found."""
        return None

    def attach(self, job_id: str, attempt: str, log: TaskLog) -> JobHandle:
        """A handle on a job found by :meth:`existing_job` (or named in a trigger event)."""
        return JobHandle(job_id=job_id, attempt=attempt)

    def before_start(  # noqa: B027  (an optional hook)
        self, owner: RunOwner, log: TaskLog, identity: str | None = None
    ) -> None:
        """Clear the way for a new job of this task instance: stop any of its jobs still running (of
        an earlier try, or of another ``identity``: changed input or model). Default: nothing."""

    # --- lifecycle -------------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self, job: JobFile, job_location: str, log: TaskLog) -> JobHandle:
        """Start the runtime on the job file at ``job_location`` (already written)."""

    @abc.abstractmethod
    def poll(self, handle: JobHandle) -> str | None:
        """The job's terminal status when it has ended, else None (also: not known without waiting)."""

    @abc.abstractmethod
    def wait(self, handle: JobHandle, log_line: LogLine, *, poll_interval: float, timeout: float | None) -> Outcome:
        """Block until the job ends, forwarding its log lines; past ``timeout`` seconds stop it (TIMEOUT)."""

    @abc.abstractmethod
    def outcome(
        self, handle: JobHandle, status: str, log_line: LogLine | None = None, *, timeout: float | None = None
    ) -> Outcome:
        """The outcome of a job that ended with ``status`` (seen by :meth:`poll` or a trigger; TIMEOUT
        when it was stopped past ``timeout`` seconds); ``log_line``: forward the job's log, which
        nobody streamed."""

    @abc.abstractmethod
    def stop(self, handle: JobHandle) -> bool:
        """Stop the job and what it started; best effort, True when something was stopped."""

    def trigger_kwargs(self, handle: JobHandle) -> dict[str, Any]:
        """What :attr:`trigger_classpath`'s trigger needs to find the job, besides the connection,
        the poll interval and the deadline."""
        return {}


def failure_message(what: str, status: str, failure: JobFailure | None, tail: str) -> str:
    """``<what> ended <status>: <the runtime's error>`` or, without an error line, the log's tail."""
    if failure is not None:
        return f"{what} ended {status}: {failure.error}"
    return f"{what} ended {status}: no error line in the driver log; last lines:\n{tail}"
