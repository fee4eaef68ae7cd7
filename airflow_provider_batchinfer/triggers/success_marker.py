"""SuccessMarkerTrigger: waits for a valid ``_SUCCESS`` in the triggerer, off the worker slots.

Filesystem calls are blocking, so each check runs in a thread (``asyncio.to_thread``) and the
triggerer's event loop, shared with every other deferred task, never stalls on a slow stage. S3
credentials cross no serialization boundary: the trigger carries only the connection id and
resolves it in the triggerer (``sync_to_async``, as Airflow asks of triggers).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import TriggerEvent

from airflow_provider_batchinfer.contract import ManifestError
from airflow_provider_batchinfer.contract.tables import TABLE_SCHEME
from airflow_provider_batchinfer.store.commit.verdicts import PROCESS_VERDICTS
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.locations import StageError
from airflow_provider_batchinfer.store.s3 import is_s3
from airflow_provider_batchinfer.triggers.base import WatchStatus, WatchTrigger, make_event


def storage_options_for(location: str, model_service_conn_id: str) -> dict[str, Any]:
    """The connection's S3 settings for an ``s3://`` location; nothing (no lookup) for local paths;
    for an Iceberg run (``iceberg://<table>/<run key>``) also its catalog."""
    if location.startswith(TABLE_SCHEME):
        from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

        return ModelServiceHook(model_service_conn_id).table_read_options()
    if not is_s3(location):
        return {}
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    options: dict[str, Any] = ModelServiceHook(model_service_conn_id).storage_options
    return options


class SuccessMarkerTrigger(WatchTrigger):
    """Fires ``success`` with the manifest (its dict) once the marker is valid, ``failed`` with a
    message when a marker exists but does not hold (a retry would not fix it), ``timeout`` at
    ``deadline`` and ``error`` when the stage could not be looked at.

    ``verify_checksums`` (default true): re-hash every listed file against its sha256; ``False``
    reads each listed file's footer instead. Either is done once per marker: the verdict is kept in
    the process (``verdicts.PROCESS_VERDICTS``, shared with the sensors' pokes), keyed by the
    marker's bytes, location and mode, so other triggers on the same run read the marker and list
    the directory, and make no request per part. Triggers deferred together on one run check it
    one at a time (``Verdicts.first_look``): one reads the parts, the others find its verdict.
    ``poke_interval`` is the former name of ``poll_interval``, still accepted so that a trigger
    serialized by an earlier version resumes after an upgrade."""

    def __init__(
        self,
        location: str,
        poll_interval: float | None = None,
        deadline: float | None = None,
        model_service_conn_id: str = "batchinfer_default",
        verify_checksums: bool = True,
        poke_interval: float | None = None,
    ) -> None:
        if poke_interval is not None:
            if poll_interval is not None:
                raise ValueError("give poll_interval (poke_interval is its former name), not both")
            if isinstance(poke_interval, bool) or not isinstance(poke_interval, (int, float)) or poke_interval <= 0:
                raise ValueError(f"poke_interval must be > 0 seconds, got {poke_interval!r}")
            poll_interval = poke_interval
        super().__init__(
            poll_interval=30.0 if poll_interval is None else poll_interval,
            deadline=deadline,
            model_service_conn_id=model_service_conn_id,
        )
        if not isinstance(location, str) or not location:
            raise ValueError(f"SuccessMarkerTrigger needs a location string, got {location!r}")
        if not isinstance(verify_checksums, bool):
            raise ValueError(f"verify_checksums must be true or false, got {verify_checksums!r}")
        self.location = location
        self.verify_checksums = verify_checksums

    def serialized_arguments(self) -> dict[str, Any]:
        return {"location": self.location, "verify_checksums": self.verify_checksums}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from asgiref.sync import sync_to_async

        options = None
        while True:
            try:
                if options is None:
                    options = await sync_to_async(storage_options_for)(self.location, self.model_service_conn_id)
                manifest = await asyncio.to_thread(
                    read_valid_manifest,
                    self.location,
                    options,
                    verify_checksums=self.verify_checksums,
                    verdicts=PROCESS_VERDICTS,
                )
            except (ManifestError, StageError) as exc:
                yield make_event(WatchStatus.FAILED, location=self.location, message=str(exc))
                return
            except Exception as exc:  # the watcher could not look; nothing is known about the marker
                yield make_event(WatchStatus.ERROR, location=self.location, message=f"{type(exc).__name__}: {exc}")
                return
            if manifest is not None:
                yield make_event(WatchStatus.SUCCESS, location=self.location, manifest=manifest.to_dict())
                return
            if self.past_deadline():
                yield make_event(WatchStatus.TIMEOUT, location=self.location)
                return
            self.log.info("No valid %s/_SUCCESS yet; checking again in %ss", self.location, self.poll_interval)
            await self.sleep_until_next_check()
