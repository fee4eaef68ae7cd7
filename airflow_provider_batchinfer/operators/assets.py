"""Airflow Asset events for committed runs: downstream DAGs scheduled on the data.

A ``BatchInferenceOperator`` declares its output as an outlet Asset, and when a try commits, the
event it emits carries the manifest's summary as its ``extra`` (run directory, rows, model, version,
sha256, ...). A DAG with ``schedule=[that asset]`` then finds the run directory in its
``triggering_asset_events`` (:func:`triggering_runs`), without knowing the upstream run id. Airflow
emits outlet events only for a task that succeeded, and the operator succeeds only after
``_SUCCESS`` was written and read back valid, so an event always names a committed run.

The asset is named after the output location by default (:func:`stage_asset`), so the producer and
a consumer in another file agree on it without sharing code:

- ``s3://bucket/prefix`` is the asset ``s3://bucket/prefix``; an absolute local path ``/data/x`` is
  ``file:///data/x``;
- a relative location (placed under the connection's ``stage_root``) is
  ``x-batchinfer://<connection id>/<location>``: the connection decides where it lands, so it is
  part of the name.

A templated location (``"{{ params.out }}"``) is only known when the task runs, but Airflow needs a
task's outlets when it parses the DAG: give ``output_asset=`` then, or the task emits no event.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.sdk import Asset

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator, Context

    from airflow_provider_batchinfer.contract import Manifest
    from airflow_provider_batchinfer.contract.specs import OutputSpec

_R = TypeVar("_R")

#: the event extra's keys, from the operator's return value (``operators/finalize.py``)
SUMMARY_KEYS = (
    "manifest_location",
    "rows",
    "input_rows",
    "error_rows",
    "model",
    "model_version",
    "sha256",
    "job_id",
    "attempt",
)


def stage_asset(location: str, conn_id: str = "batchinfer_default") -> Asset:
    """The Asset an operator writing to ``location`` (its ``base_stage_location`` or
    ``stage_location``) emits by default; use it in ``schedule=[...]`` of a consumer DAG."""
    if not isinstance(location, str) or not location.strip():
        raise ValueError(f"an asset needs an output location, got {location!r}")
    location = location.strip()
    if "{{" in location:
        raise ValueError(
            f"{location!r} is templated, so it is only known when the task runs; name the asset yourself: "
            "BatchInferenceOperator(output_asset=Asset('...'))"
        )
    if "://" in location:
        uri = location.rstrip("/")
    elif location.startswith("/"):
        uri = "file://" + (location.rstrip("/") or "/")
    else:
        uri = f"x-batchinfer://{conn_id}/{location.strip('/')}"
    return Asset(name=uri, uri=uri)


def attach_output_asset(
    operator: BaseOperator, output_spec: OutputSpec, output_asset: Asset | str | bool | None, conn_id: str
) -> Asset | None:
    """The operator's output Asset (``output_asset``: ``True`` for the default name, an ``Asset``
    or an asset name, ``False``/``None`` for none), added to its ``outlets``."""
    if output_asset is None or output_asset is False:
        return None
    if output_asset is True:
        table = getattr(output_spec, "table", None)  # an Iceberg table output is named after the table
        location = (
            (f"iceberg://{table}" if table else "")
            or output_spec.base_stage_location
            or output_spec.stage_location
            or ""
        )
        if "{{" in location:  # only known at run time: no default name (see the module docstring)
            return None
        asset = stage_asset(location, conn_id)
    elif isinstance(output_asset, Asset):
        asset = output_asset
    elif isinstance(output_asset, str):
        asset = Asset(name=output_asset)
    else:
        raise TypeError(f"output_asset must be an Asset, an asset name, True or False; got {output_asset!r}")
    operator.outlets = [*operator.outlets, asset]
    return asset


def event_extra(result: Mapping[str, Any]) -> dict[str, Any]:
    """The event's ``extra``: the committed run's summary (the operator's return value, trimmed)."""
    extra: dict[str, Any] = {"run_dir": result["output_location"]}
    extra.update({k: result[k] for k in SUMMARY_KEYS if k in result})
    usage = result.get("usage") or {}
    if usage.get("cost") is not None:  # what the run cost, for dashboards on the asset
        extra["cost"] = usage["cost"]
    return extra


def emits_asset_event(method: Callable[..., _R]) -> Callable[..., _R]:
    """Wrap ``execute`` / ``execute_complete``: once the run is committed (the method returned),
    put its summary on the output Asset's event; Airflow emits it when the task succeeds."""

    @functools.wraps(method)
    def wrapper(self: Any, context: Context, *args: Any, **kwargs: Any) -> _R:
        result = method(self, context, *args, **kwargs)
        asset = getattr(self, "output_asset", None)
        if asset is not None and isinstance(result, Mapping):
            events = context.get("outlet_events")
            if events is not None:  # absent when execute() is called outside a task runner
                events[asset].extra.update(event_extra(result))
                self.log.info("Asset event for %s: run directory %s", asset.uri, result.get("output_location"))
        return result

    return wrapper


def triggering_runs(context: Context, asset: Asset | None = None) -> list[dict[str, Any]]:
    """The committed runs that triggered this DAG run: each event's ``extra`` (``run_dir``,
    ``manifest_location``, ``rows``, ``model``, ``model_version``, ``sha256``, ...), oldest first,
    from ``asset`` or every triggering asset. Events from anything but a batch inference task
    (no ``run_dir``) are left out; none at all raises ``LookupError``, saying what was there."""
    events = context.get("triggering_asset_events") or {}
    keys = [asset] if asset is not None else list(events)
    found = []
    for key in keys:
        for event in events.get(key, []):
            extra = dict(event.extra or {})
            if "run_dir" in extra:
                found.append((event.timestamp, extra))
    if not found:
        raise LookupError(
            f"no batch inference run among the triggering asset events ({[getattr(k, 'uri', k) for k in events]}); "
            "schedule this DAG on the inference task's output asset (operators.assets.stage_asset)"
        )
    return [extra for _, extra in sorted(found, key=lambda item: item[0])]


def read_triggering_run(
    context: Context, storage_options: dict[str, Any] | None = None, asset: Asset | None = None
) -> tuple[dict[str, Any], Manifest]:
    """The newest triggering run (:func:`triggering_runs`) and its ``_SUCCESS`` manifest, validated
    (every listed file present with its size and footer). Fails when the run directory no longer
    holds that commit: its marker is gone, or a later attempt re-committed it (the event is stale)."""
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    run = triggering_runs(context, asset)[-1]
    manifest = read_valid_manifest(run["run_dir"], storage_options)
    if manifest is None:
        raise LookupError(f"{run['run_dir']} has no _SUCCESS any more: the run the asset event names was removed")
    if manifest.job.attempt != run.get("attempt", manifest.job.attempt):
        raise LookupError(
            f"{run['run_dir']} was committed again by attempt {manifest.job.attempt} after the event of attempt "
            f"{run['attempt']}; the newer commit emits its own event"
        )
    return run, manifest
