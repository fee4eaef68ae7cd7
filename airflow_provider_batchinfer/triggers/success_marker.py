"""SuccessMarkerTrigger: waits for a valid ``_SUCCESS`` in the triggerer, off the worker slots.

Filesystem calls are blocking, so each check runs in a thread (``asyncio.to_thread``) and the
triggerer's event loop, shared with every other deferred task, never stalls on a slow stage. S3
credentials cross no serialization boundary: the trigger carries only the connection id and
resolves it in the triggerer (``sync_to_async``, as Airflow asks of triggers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_batchinfer.s3 import is_s3
from airflow_provider_batchinfer.stage import ManifestError, StageError, read_valid_manifest


def storage_options_for(location: str, model_service_conn_id: str) -> dict[str, Any]:
    """The connection's S3 settings for an ``s3://`` location; nothing (no lookup) for local paths."""
    if not is_s3(location):
        return {}
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    return ModelServiceHook(model_service_conn_id).storage_options


class SuccessMarkerTrigger(BaseTrigger):
    """Fires ``{"status": "success", "manifest": ...}`` once the marker is valid,
    ``{"status": "error", "message": ...}`` when a marker exists but its manifest does not hold, or
    ``{"status": "timeout"}`` at ``deadline`` (epoch seconds). The deadline is enforced here as well
    as by the scheduler's deferral timeout, so a trigger run outside the scheduler (``dag.test()``)
    still ends."""

    def __init__(self, location: str, poke_interval: float = 30.0, deadline: float | None = None,
                 model_service_conn_id: str = "batchinfer_default") -> None:
        super().__init__()
        if not isinstance(location, str) or not location:
            raise ValueError(f"SuccessMarkerTrigger needs a location string, got {location!r}")
        if poke_interval <= 0:
            raise ValueError(f"poke_interval must be > 0 seconds, got {poke_interval!r}")
        if deadline is not None and not isinstance(deadline, (int, float)):
            raise ValueError(f"deadline must be epoch seconds, got {deadline!r}")
        if not isinstance(model_service_conn_id, str) or not model_service_conn_id:
            raise ValueError(f"model_service_conn_id must be a connection id, got {model_service_conn_id!r}")
        self.location = location
        self.model_service_conn_id = model_service_conn_id
        self.poke_interval = float(poke_interval)
        self.deadline = None if deadline is None else float(deadline)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"location": self.location, "poke_interval": self.poke_interval, "deadline": self.deadline,
             "model_service_conn_id": self.model_service_conn_id},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from asgiref.sync import sync_to_async

        options = None
        while True:
            try:
                if options is None:
                    options = await sync_to_async(storage_options_for)(self.location, self.model_service_conn_id)
                manifest = await asyncio.to_thread(read_valid_manifest, self.location, options)
            except (ManifestError, StageError, OSError) as exc:
                yield TriggerEvent({"status": "error", "location": self.location, "message": str(exc)})
                return
            if manifest is not None:
                yield TriggerEvent({"status": "success", "location": self.location, "manifest": manifest})
                return
            if self.deadline is not None and time.time() >= self.deadline:
                yield TriggerEvent({"status": "timeout", "location": self.location})
                return
            self.log.info("No valid %s/_SUCCESS yet; checking again in %ss", self.location, self.poke_interval)
            delay = self.poke_interval
            if self.deadline is not None:
                delay = max(0.0, min(delay, self.deadline - time.time()))
            await asyncio.sleep(delay)
