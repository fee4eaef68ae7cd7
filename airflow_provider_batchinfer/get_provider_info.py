"""What ``airflow providers list`` and the connection form know about this provider.

Kept import-free: the providers manager reads it without importing any hook.
"""

from __future__ import annotations

from typing import Any


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
            {"integration-name": "Batch Inference",
             "python-modules": ["airflow_provider_batchinfer.operators.batch_inference"]}
        ],
        "sensors": [
            {"integration-name": "Batch Inference",
             "python-modules": ["airflow_provider_batchinfer.sensors.success_marker"]}
        ],
        "hooks": [
            {"integration-name": "Batch Inference",
             "python-modules": ["airflow_provider_batchinfer.hooks.model_service"]}
        ],
        "triggers": [
            {"integration-name": "Batch Inference",
             "python-modules": ["airflow_provider_batchinfer.triggers.success_marker"]}
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_provider_batchinfer.hooks.model_service.ModelServiceHook",
                "hook-name": "Batch Inference Model Service",
                "connection-type": "batchinfer",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "port"],
                    "relabeling": {"host": "Ray address (empty: local Ray on the worker)",
                                   "login": "AWS access key id (s3:// locations)",
                                   "password": "AWS secret access key (s3:// locations)"},
                    "placeholders": {
                        "host": "leave empty for the embedded local launcher, or ray://head:10001 / auto",
                        "login": "empty: use aws_conn_id or the AWS default credential chain",
                        "extra": '{"stage_root": "/data/batchinfer/stage", "registry_root": "/data/batchinfer/registry"}',
                    },
                },
                "conn-fields": {
                    "stage_root": {
                        "label": "Stage root",
                        "description": "Where relative stage locations (outputs, materialized inputs) are placed.",
                        "schema": {"type": ["string", "null"]},
                    },
                    "registry_root": {
                        "label": "Model registry root",
                        "description": "Where logged models live: <root>/<name>/<version>/.",
                        "schema": {"type": ["string", "null"]},
                    },
                    "endpoint_url": {
                        "label": "S3 endpoint URL",
                        "description": "For S3-compatible stores (MinIO, R2, ...): e.g. http://minio:9000. "
                        "Empty: AWS S3.",
                        "schema": {"type": ["string", "null"]},
                    },
                    "region_name": {
                        "label": "S3 region",
                        "description": "Region of the buckets (us-east-1, auto for R2, ...).",
                        "schema": {"type": ["string", "null"]},
                    },
                    "aws_conn_id": {
                        "label": "AWS connection id",
                        "description": "Take S3 credentials, endpoint and region from this aws connection "
                        "(fields set here win).",
                        "schema": {"type": ["string", "null"]},
                    },
                    "launcher": {
                        "label": "Launcher",
                        "description": "'local' runs the job as a subprocess of the task with a local or attached Ray.",
                        "schema": {"type": ["string", "null"], "enum": ["local", None], "default": "local"},
                    },
                },
            }
        ],
    }
