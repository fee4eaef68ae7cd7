"""SuccessMarkerSensor: gate downstream tasks on a committed run directory.

It trusts only a ``_SUCCESS`` whose manifest follows the contract (``Manifest.from_dict``) and
describes the files beside it: each listed file present with its size, a Parquet footer holding its
row count and the sha256 of its bytes, counts reconciled. Reading every part (its footer, or all
of it to hash) is done once per marker: the verdict is kept in the process, keyed by the marker's
bytes, its location and the mode, so a later look at the same marker, with or without checksums,
reads the marker and lists the directory (names, sizes, modification times) and makes no request
per part, whatever the number of parts. It pushes that manifest (its dict) to
XCom so ``publish`` reads exactly the committed files and nothing else. A marker that exists but
does not hold fails the task at once: waiting would not fix it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, Manifest, ManifestError
from airflow_provider_batchinfer.store.commit.verdicts import PROCESS_VERDICTS
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.locations import StageError
from airflow_provider_batchinfer.triggers.base import WatchStatus, validate_event
from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger, storage_options_for

if TYPE_CHECKING:
    from airflow.sdk import Context


class SuccessMarkerSensor(BaseSensorOperator):
    """Wait for ``<location>/_SUCCESS`` with a valid manifest; return the manifest (its dict).

    :param location: the run directory (e.g. ``infer.output["output_location"]``).
    :param deferrable: wait in the triggerer instead of holding a worker slot (default: the
        ``[operators] default_deferrable`` setting).
    :param model_service_conn_id: the ``batchinfer`` connection whose S3 settings and credentials
        open an ``s3://`` location (ignored for local paths).
    :param verify_checksums: re-hash every listed file against the sha256 in the manifest (the
        default: reads every byte once per marker, so a part changed after the commit fails the
        sensor; a part rewritten after that shows in the listing and is hashed again). ``False``
        checks only names, sizes and Parquet footers (the footers once per marker), and lets a
        marker without checksums (format 1) pass.
    Supports ``mode="reschedule"`` like any sensor.
    """

    template_fields: Sequence[str] = ("location", "model_service_conn_id")
    ui_color = "#d9f2e6"

    def __init__(
        self,
        *,
        location: str,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        model_service_conn_id: str = "batchinfer_default",
        verify_checksums: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.location = location
        self.deferrable = deferrable
        self.model_service_conn_id = model_service_conn_id
        self.verify_checksums = verify_checksums

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        result = self.poke(context)
        if result.is_done:
            return result.xcom_value
        self.defer(
            trigger=SuccessMarkerTrigger(
                location=self.location,
                poll_interval=self.poke_interval,
                deadline=time.time() + self.timeout,
                model_service_conn_id=self.model_service_conn_id,
                verify_checksums=self.verify_checksums,
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def poke(self, context: Context) -> PokeReturnValue:
        try:
            manifest = read_valid_manifest(
                self.location,
                storage_options_for(self.location, self.model_service_conn_id),
                verify_checksums=self.verify_checksums,
                verdicts=PROCESS_VERDICTS,
            )
        except (ManifestError, StageError) as exc:
            raise AirflowFailException(self._does_not_hold(str(exc))) from exc
        if manifest is None:
            self.log.info("Waiting for %s/%s", self.location, SUCCESS_MARKER)
            return PokeReturnValue(is_done=False)
        self._log_committed(manifest)
        return PokeReturnValue(is_done=True, xcom_value=manifest.to_dict())

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        event = validate_event(event, "location")
        status = WatchStatus(event["status"])
        if status is WatchStatus.TIMEOUT:
            raise AirflowSensorTimeout(f"no valid {self.location}/{SUCCESS_MARKER} within {self.timeout}s")
        if status is WatchStatus.FAILED:
            raise AirflowFailException(self._does_not_hold(str(event.get("message"))))
        if status is WatchStatus.ERROR:
            raise AirflowException(
                f"could not check {self.location}/{SUCCESS_MARKER}: {event.get('message')}; "
                "a retry of the task looks again"
            )
        event = validate_event(event, "manifest")
        try:
            manifest = Manifest.from_dict(event["manifest"], f"{self.location}/{SUCCESS_MARKER}")
        except ManifestError as exc:
            raise AirflowFailException(self._does_not_hold(str(exc))) from exc
        self._log_committed(manifest)
        return manifest.to_dict()

    def _does_not_hold(self, message: str) -> str:
        return (
            f"{self.location} has a {SUCCESS_MARKER} marker that does not hold: {message}. Waiting will not fix "
            "it: re-run the task that writes this run directory"
        )

    def _log_committed(self, manifest: Manifest) -> None:
        self.log.info(
            "%s is committed: %s rows in %d file(s), model %s/%s%s",
            self.location,
            manifest.counts.output_rows,
            len(manifest.files),
            manifest.model.name,
            manifest.model.version,
            " (checksums verified)" if self.verify_checksums else "",
        )
