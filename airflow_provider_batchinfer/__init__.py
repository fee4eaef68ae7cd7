"""Batch inference as an Airflow task: one operator call, per-run output, a ``_SUCCESS`` gate.

The public names are loaded lazily: the Ray side imports ``airflow_provider_batchinfer.runtime``,
which imports this package first, and must never pull Airflow in with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer import _moved

# modules that moved into concept folders keep their old import path for one release (_moved.py)
_moved.install()

__version__ = "0.1.0"

_EXPORTS = {
    "BatchInferenceOperator": "airflow_provider_batchinfer.operators.batch_inference",
    "SuccessMarkerSensor": "airflow_provider_batchinfer.sensors.success_marker",
    "ModelServiceHook": "airflow_provider_batchinfer.hooks.model_service",
    "SuccessMarkerTrigger": "airflow_provider_batchinfer.triggers.success_marker",
    "InputSpec": "airflow_provider_batchinfer.contract.specs",
    "OutputSpec": "airflow_provider_batchinfer.contract.specs",
    "JobSpec": "airflow_provider_batchinfer.contract.specs",
    "SaveMode": "airflow_provider_batchinfer.contract.specs",
    "SpecError": "airflow_provider_batchinfer.contract.specs",
}

__all__ = [  # noqa: RUF022  (the order of the README's import line)
    "BatchInferenceOperator",
    "SuccessMarkerSensor",
    "ModelServiceHook",
    "SuccessMarkerTrigger",
    "InputSpec",
    "OutputSpec",
    "JobSpec",
    "SaveMode",
    "SpecError",
    "__version__",
]

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec, SaveMode, SpecError
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.operators.batch_inference import BatchInferenceOperator
    from airflow_provider_batchinfer.sensors.success_marker import SuccessMarkerSensor
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
