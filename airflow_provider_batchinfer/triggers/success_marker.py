"""SuccessMarkerTrigger: waits for a valid ``_SUCCESS`` in the triggerer, off the worker slots.

Filesystem calls are blocking, so each check runs in a thread (``asyncio.to_thread``) and the
triggerer's event loop, shared with every other deferred task, never stalls on a slow stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_batchinfer.stage import ManifestError, StageError, read_valid_manifest


class SuccessMarkerTrigger(BaseTrigger):
    """Fires ``{"status": "success", "manifest": ...}`` once the marker is valid, or
    ``{"status": "error", "message": ...}`` when a marker exists but its manifest does not hold."""

    def __init__(self, location: str, poke_interval: float = 30.0) -> None:
        super().__init__()
        if not isinstance(location, str) or not location:
            raise ValueError(f"SuccessMarkerTrigger needs a location string, got {location!r}")
        if poke_interval <= 0:
            raise ValueError(f"poke_interval must be > 0 seconds, got {poke_interval!r}")
        self.location = location
        self.poke_interval = float(poke_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"location": self.location, "poke_interval": self.poke_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            try:
                manifest = await asyncio.to_thread(read_valid_manifest, self.location)
            except (ManifestError, StageError, OSError) as exc:
                yield TriggerEvent({"status": "error", "location": self.location, "message": str(exc)})
                return
            if manifest is not None:
                yield TriggerEvent({"status": "success", "location": self.location, "manifest": manifest})
                return
            self.log.info("No valid %s/_SUCCESS yet; checking again in %ss", self.location, self.poke_interval)
            await asyncio.sleep(self.poke_interval)
