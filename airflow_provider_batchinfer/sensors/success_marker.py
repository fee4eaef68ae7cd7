"""SuccessMarkerSensor: gate downstream tasks on a committed run directory.

It trusts only a ``_SUCCESS`` whose manifest describes the files beside it (each listed file
present with its size, counts reconciled), and pushes that manifest to XCom so ``publish`` reads
exactly the committed files and nothing else. A marker that exists but does not hold fails the
task at once: waiting would not fix it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout

from airflow_provider_batchinfer.stage import ManifestError, StageError, read_valid_manifest
from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger, storage_options_for

if TYPE_CHECKING:
    from airflow.sdk import Context


class SuccessMarkerSensor(BaseSensorOperator):
    """Wait for ``<location>/_SUCCESS`` with a valid manifest; return the manifest.

    :param location: the run directory (e.g. ``infer.output["output_location"]``).
    :param deferrable: wait in the triggerer instead of holding a worker slot.
    :param model_service_conn_id: the ``batchinfer`` connection whose S3 settings and credentials
        open an ``s3://`` location (ignored for local paths).
    Supports ``mode="reschedule"`` like any sensor.
    """

    template_fields: Sequence[str] = ("location", "model_service_conn_id")
    ui_color = "#d9f2e6"

    def __init__(self, *, location: str, deferrable: bool = False,
                 model_service_conn_id: str = "batchinfer_default", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.location = location
        self.deferrable = deferrable
        self.model_service_conn_id = model_service_conn_id

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        result = self.poke(context)
        if result.is_done:
            return result.xcom_value
        self.defer(
            trigger=SuccessMarkerTrigger(
                location=self.location, poke_interval=self.poke_interval, deadline=time.time() + self.timeout,
                model_service_conn_id=self.model_service_conn_id,
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def poke(self, context: Context) -> PokeReturnValue:
        try:
            manifest = read_valid_manifest(self.location, storage_options_for(self.location, self.model_service_conn_id))
        except (ManifestError, StageError) as exc:
            raise AirflowFailException(f"{self.location} has a _SUCCESS marker that does not hold: {exc}") from exc
        if manifest is None:
            self.log.info("Waiting for %s/_SUCCESS", self.location)
            return PokeReturnValue(is_done=False)
        counts = manifest["counts"]
        self.log.info("%s is committed: %s rows in %d file(s), model %s/%s", self.location, counts["output_rows"],
                      len(manifest["files"]), manifest["model"]["name"], manifest["model"]["version"])
        return PokeReturnValue(is_done=True, xcom_value=manifest)

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        if not event or event.get("status") not in ("success", "error", "timeout"):
            raise AirflowException(f"unexpected trigger event for {self.location}: {event!r}")
        if event["status"] == "timeout":
            raise AirflowSensorTimeout(f"no valid {self.location}/_SUCCESS within {self.timeout}s")
        if event["status"] == "error":
            raise AirflowFailException(f"{self.location} has a _SUCCESS marker that does not hold: {event['message']}")
        return event["manifest"]
