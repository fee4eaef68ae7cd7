"""RayJobTrigger: watches a submitted Ray job from the triggerer, off the worker slots.

The Jobs API client is synchronous (``requests``), so every call runs in a thread and the
triggerer's shared event loop never blocks. On every poll it also fetches the job's driver log and
logs the complete lines past ``log_offset`` (progress, rows/s, ETA), so a deferred task's log shows
the job as it runs; every event carries the offset it reached, and ``execute_complete`` forwards
only what the trigger did not log. The trigger only reports state in the shared vocabulary
(:class:`~airflow_provider_batchinfer.triggers.base.WatchStatus`): ``success``; ``failed`` with the
job's status (``FAILED``/``STOPPED``) and message; ``timeout`` when its own ``deadline`` passed (it
stops the job first: a scheduler-side deferral timeout alone would leave the job running);
``error`` when it could not look. The operator decides pass or fail in ``execute_complete``.
``on_kill`` stops the job when a user marks the task failed or clears it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import TriggerEvent

from airflow_provider_batchinfer.launchers.base import SUCCEEDED, TERMINAL
from airflow_provider_batchinfer.launchers.ray_jobs import new_log_lines
from airflow_provider_batchinfer.triggers.base import WatchStatus, WatchTrigger, make_event

if TYPE_CHECKING:
    from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher


class RayJobTrigger(WatchTrigger):
    """Every event carries ``submission_id`` (also as ``job_id``, the launcher-neutral key),
    ``job_status`` (the Jobs API status, or ``TIMEOUT`` / ``UNKNOWN``) and ``log_offset`` (how much
    of the driver log this trigger logged). ``log_offset`` as an argument: where to start (a trigger
    that a triggerer hand-over restarts does not log the lines again)."""

    def __init__(
        self,
        submission_id: str,
        model_service_conn_id: str,
        poll_interval: float = 10.0,
        deadline: float | None = None,
        log_offset: int = 0,
    ) -> None:
        super().__init__(poll_interval=poll_interval, deadline=deadline, model_service_conn_id=model_service_conn_id)
        if not submission_id or not isinstance(submission_id, str):
            raise ValueError(f"RayJobTrigger needs a submission_id, got {submission_id!r}")
        if isinstance(log_offset, bool) or not isinstance(log_offset, int) or log_offset < 0:
            raise ValueError(f"log_offset must be a character offset >= 0, got {log_offset!r}")
        self.submission_id = submission_id
        self.log_offset = log_offset

    def serialized_arguments(self) -> dict[str, Any]:
        return {"submission_id": self.submission_id, "log_offset": self.log_offset}

    def _launcher(self) -> RayJobsLauncher:
        from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

        return ModelServiceHook(model_service_conn_id=self.model_service_conn_id).get_ray_jobs_launcher()

    def _event(self, status: WatchStatus, job_status: str, message: str) -> TriggerEvent:
        return make_event(
            status,
            submission_id=self.submission_id,
            job_id=self.submission_id,
            job_status=job_status,
            message=message,
            log_offset=self.log_offset,
        )

    async def _forward_log(self, launcher: RayJobsLauncher, final: bool) -> None:
        """Log the driver log's new complete lines (all of the rest when ``final``). A log that
        cannot be fetched is only a missed look: the next poll catches up from the same offset."""
        try:
            text = await asyncio.to_thread(launcher.logs, self.submission_id)
        except Exception as exc:
            self.log.warning("Could not fetch the driver log of Ray job %s: %s", self.submission_id, exc)
            return
        lines, self.log_offset = new_log_lines(text, self.log_offset, final)
        for line in lines:
            self.log.info("%s", line)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            launcher = await asyncio.to_thread(self._launcher)
            while True:
                status = await asyncio.to_thread(launcher.status, self.submission_id)
                await self._forward_log(launcher, final=status in TERMINAL)
                if status in TERMINAL:
                    info = await asyncio.to_thread(launcher.find, self.submission_id)
                    message = str((info or {}).get("message") or "")
                    yield self._event(
                        WatchStatus.SUCCESS if status == SUCCEEDED else WatchStatus.FAILED, status, message
                    )
                    return
                if self.past_deadline():
                    await asyncio.to_thread(launcher.stop_job, self.submission_id)
                    yield self._event(WatchStatus.TIMEOUT, "TIMEOUT", "the job ran past its timeout and was stopped")
                    return
                self.log.info("Ray job %s is %s", self.submission_id, status)
                await self.sleep_until_next_check()
        except Exception as exc:  # reported to the operator, which fails the task with it
            yield self._event(WatchStatus.ERROR, "UNKNOWN", f"{type(exc).__name__}: {exc}")

    async def on_kill(self) -> None:
        launcher = await asyncio.to_thread(self._launcher)
        stopped = await asyncio.to_thread(launcher.stop_job, self.submission_id)
        self.log.info("Stopped Ray job %s on kill: %s", self.submission_id, stopped)
