"""What ``airflow providers list`` and the connection form know about this provider.

Kept light: the providers manager reads it without importing any hook, so the connection form
comes from ``hooks/connection_fields.py`` (plain data, also what the hook's
``get_ui_field_behaviour`` returns).
"""

from __future__ import annotations

from typing import Any

from airflow_provider_batchinfer.hooks.connection_fields import CONN_TYPE, conn_fields, provider_ui_field_behaviour


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-batchinfer",
        "name": "Batch Inference",
        "description": "Batch inference on Ray as an Airflow task: model registry, per-run stage directories, "
        "a _SUCCESS commit protocol and a sensor that gates downstream tasks on it.",
        "versions": ["0.1.0"],
        "integrations": [
            {
                "integration-name": "Batch Inference",
                "external-doc-url": "https://pypi.org/project/airflow-provider-batchinfer/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "Batch Inference",
                "python-modules": ["airflow_provider_batchinfer.operators.batch_inference"],
            }
        ],
        "sensors": [
            {
                "integration-name": "Batch Inference",
                "python-modules": ["airflow_provider_batchinfer.sensors.success_marker"],
            }
        ],
        "hooks": [
            {
                "integration-name": "Batch Inference",
                "python-modules": ["airflow_provider_batchinfer.hooks.model_service"],
            }
        ],
        "triggers": [
            {
                "integration-name": "Batch Inference",
                "python-modules": [
                    "airflow_provider_batchinfer.triggers.success_marker",
                    "airflow_provider_batchinfer.triggers.ray_job",
                ],
            }
        ],
        "extra-links": ["airflow_provider_batchinfer.links.ray_dashboard.RayJobLink"],
        "connection-types": [
            {
                "hook-class-name": "airflow_provider_batchinfer.hooks.model_service.ModelServiceHook",
                "hook-name": "Batch Inference Model Service",
                "connection-type": CONN_TYPE,
                "ui-field-behaviour": provider_ui_field_behaviour(),
                "conn-fields": conn_fields(),
            }
        ],
    }
