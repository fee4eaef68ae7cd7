"""What every batchinfer trigger shares: validated arguments, the deadline, one event vocabulary.

A trigger's arguments cross a serialization boundary (the metadata DB), so they are checked once,
here, in ``__init__``, the way the Databricks provider does; ``serialize`` computes the classpath
from the class. Events use one vocabulary, :class:`WatchStatus`, and the operator or sensor that
deferred validates an event with :func:`validate_event` before reading it (the Amazon provider's
``validate_execute_complete_event``): the trigger reports state, the task decides pass or fail.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import time
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException
from airflow.triggers.base import BaseTrigger, TriggerEvent

if TYPE_CHECKING:
    from airflow_provider_batchinfer.launchers.base import JobHandle, Launcher


class WatchStatus(str, enum.Enum):
    """How a watch ended. ``SUCCESS``: what was watched is done and good. ``FAILED``: it ended and is
    not good (a job that failed or was stopped, a marker whose manifest does not hold).
    ``TIMEOUT``: the deadline passed first. ``ERROR``: the watcher itself could not look (the Jobs
    API unreachable): nothing is known about the watched thing."""

    SUCCESS = "success"
    FAILED = "failed"
    TIMEOUT = "timeout"
    ERROR = "error"


def make_event(status: WatchStatus, **payload: Any) -> TriggerEvent:
    """A trigger event in the shared vocabulary; the payload must be JSON-serializable."""
    return TriggerEvent({"status": status.value, **payload})


def validate_event(event: dict[str, Any] | None, *required: str) -> dict[str, Any]:
    """The event a trigger sent, checked before any of it is read: a dict with a known ``status``
    and every key in ``required``. Anything else is a bug or a foreign trigger: fail clearly."""
    if not isinstance(event, dict):
        raise AirflowException(f"trigger event is missing or not a dict: {event!r}")
    status = event.get("status")
    if status not in {s.value for s in WatchStatus}:
        raise AirflowException(f"trigger event has an unknown status {status!r}: {event!r}")
    missing = [key for key in required if key not in event]
    if missing:
        raise AirflowException(f"trigger event lacks {missing}: {event!r}")
    return event


def event_log_offset(event: dict[str, Any]) -> int:
    """How much of the job's log the trigger that sent ``event`` already logged (``log_offset``;
    0 from a trigger that logged none): the task forwards only the rest."""
    offset = event.get("log_offset", 0)
    return offset if isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0 else 0


class WatchTrigger(BaseTrigger):
    """Base of triggers that check something every ``poll_interval`` seconds until ``deadline``
    (epoch seconds; None: no deadline). The deadline is enforced here as well as by the scheduler's
    deferral timeout, so a trigger run outside the scheduler (``dag.test()``) still ends."""

    def __init__(self, *, poll_interval: float, deadline: float | None, model_service_conn_id: str) -> None:
        super().__init__()
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)) or poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
            raise ValueError(f"deadline must be epoch seconds or None, got {deadline!r}")
        if not isinstance(model_service_conn_id, str) or not model_service_conn_id:
            raise ValueError(f"model_service_conn_id must be a connection id, got {model_service_conn_id!r}")
        self.poll_interval = float(poll_interval)
        self.deadline = None if deadline is None else float(deadline)
        self.model_service_conn_id = model_service_conn_id

    def serialized_arguments(self) -> dict[str, Any]:
        """The subclass's own arguments; the shared ones are added by :meth:`serialize`."""
        return {}

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                **self.serialized_arguments(),
                "poll_interval": self.poll_interval,
                "deadline": self.deadline,
                "model_service_conn_id": self.model_service_conn_id,
            },
        )

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline

    async def sleep_until_next_check(self) -> None:
        """Sleep ``poll_interval``, never past the deadline (so a timeout is reported on time)."""
        delay = self.poll_interval
        if self.deadline is not None:
            delay = max(0.0, min(delay, self.deadline - time.time()))
        await asyncio.sleep(delay)


def job_trigger(
    launcher: Launcher, handle: JobHandle, *, conn_id: str, poll_interval: float, deadline: float | None
) -> BaseTrigger:
    """The trigger that watches ``handle``'s job from the triggerer: the launcher's
    ``trigger_classpath`` with its ``trigger_kwargs``. NotImplementedError for a launcher whose job
    runs inside the task."""
    if launcher.trigger_classpath is None:
        raise NotImplementedError(f"the {launcher.name} launcher cannot defer: its job runs inside the task")
    module, _, name = launcher.trigger_classpath.rpartition(".")
    trigger_class = getattr(importlib.import_module(module), name)
    trigger: BaseTrigger = trigger_class(
        **launcher.trigger_kwargs(handle), model_service_conn_id=conn_id, poll_interval=poll_interval, deadline=deadline
    )
    return trigger
