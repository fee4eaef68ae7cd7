"""RayJobTrigger: watches a submitted Ray job from the triggerer, off the worker slots.

The Jobs API client is synchronous (``requests``), so every call runs in a thread and the
triggerer's shared event loop never blocks. The trigger only reports state; the operator decides
pass or fail in ``execute_complete``. Its own ``deadline`` stops the job and reports a timeout
(a scheduler-side deferral timeout alone would leave the job running), and ``on_kill`` stops the
job when a user marks the task failed or clears it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_batchinfer.launchers.ray_jobs import TERMINAL


class RayJobTrigger(BaseTrigger):
    def __init__(
        self,
        submission_id: str,
        model_service_conn_id: str,
        poll_interval: float = 10.0,
        deadline: float | None = None,
    ) -> None:
        super().__init__()
        if not submission_id or not isinstance(submission_id, str):
            raise ValueError(f"RayJobTrigger needs a submission_id, got {submission_id!r}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        if deadline is not None and not isinstance(deadline, (int, float)):
            raise ValueError(f"deadline must be epoch seconds, got {deadline!r}")
        self.submission_id = submission_id
        self.model_service_conn_id = model_service_conn_id
        self.poll_interval = float(poll_interval)
        self.deadline = None if deadline is None else float(deadline)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "submission_id": self.submission_id,
                "model_service_conn_id": self.model_service_conn_id,
                "poll_interval": self.poll_interval,
                "deadline": self.deadline,
            },
        )

    def _launcher(self):
        from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

        return ModelServiceHook(model_service_conn_id=self.model_service_conn_id).get_ray_jobs_launcher()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            launcher = await asyncio.to_thread(self._launcher)
            while True:
                status = await asyncio.to_thread(launcher.status, self.submission_id)
                if status in TERMINAL:
                    info = await asyncio.to_thread(launcher.find, self.submission_id)
                    yield TriggerEvent({"status": status, "submission_id": self.submission_id,
                                        "message": (info or {}).get("message") or ""})
                    return
                if self.deadline is not None and time.time() >= self.deadline:
                    await asyncio.to_thread(launcher.stop, self.submission_id)
                    yield TriggerEvent({"status": "TIMEOUT", "submission_id": self.submission_id,
                                        "message": "the job ran past its timeout and was stopped"})
                    return
                self.log.info("Ray job %s is %s", self.submission_id, status)
                delay = self.poll_interval
                if self.deadline is not None:
                    delay = max(0.0, min(delay, self.deadline - time.time()))
                await asyncio.sleep(delay)
        except Exception as exc:  # reported to the operator, which fails the task with it
            yield TriggerEvent({"status": "ERROR", "submission_id": self.submission_id,
                                "message": f"{type(exc).__name__}: {exc}"})

    async def on_kill(self) -> None:
        launcher = await asyncio.to_thread(self._launcher)
        stopped = await asyncio.to_thread(launcher.stop, self.submission_id)
        self.log.info("Stopped Ray job %s on kill: %s", self.submission_id, stopped)
