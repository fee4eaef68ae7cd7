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
             "python-modules": ["airflow_provider_batchinfer.triggers.success_marker",
                                "airflow_provider_batchinfer.triggers.ray_job"]}
        ],
        "extra-links": ["airflow_provider_batchinfer.links.ray_dashboard.RayJobLink"],
        "connection-types": [
            {
                "hook-class-name": "airflow_provider_batchinfer.hooks.model_service.ModelServiceHook",
                "hook-name": "Batch Inference Model Service",
                "connection-type": "batchinfer",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "port"],
                    "relabeling": {"host": "Ray address",
                                   "login": "AWS access key id (s3:// locations)",
                                   "password": "AWS secret access key (s3:// locations)"},
                    "placeholders": {
                        "host": "local launcher: empty (a local Ray per job) or 127.0.0.1:6379; "
                        "ray_jobs: the dashboard, e.g. http://ray-head:8265",
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
                    "allowed_roots": {
                        "label": "Allowed file roots",
                        "description": "Besides the stage root, where InputSpec.column_handling may read the files "
                        "a column points at: comma-separated absolute paths or URIs (s3://bucket/prefix).",
                        "schema": {"type": ["string", "null"]},
                    },
                    "llm_engine": {
                        "label": "LLM engine",
                        "description": "Default engine of text_generation jobs: 'vllm' (GPU, ray.data.llm) or "
                        "'transformers' (CPU). Empty: vLLM exactly when the job asks for GPUs.",
                        "schema": {"type": ["string", "null"], "enum": ["vllm", "transformers", None]},
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
                        "description": "'local' runs the job as a subprocess of the task with a local or attached Ray; "
                        "'ray_jobs' submits it to the Ray Jobs API at the host address.",
                        "schema": {"type": ["string", "null"], "enum": ["local", "ray_jobs", None], "default": "local"},
                    },
                    "runtime_env": {
                        "label": "Ray runtime_env (ray_jobs)",
                        "description": "Defaults for submitted jobs, e.g. {\"pip\": [...]} or {\"image_uri\": ...}.",
                        "schema": {"type": ["object", "null"]},
                    },
                    "ray_token": {
                        "label": "Ray auth token (ray_jobs)",
                        "description": "Token of a Ray cluster with token auth (`ray get-auth-token`); sent as a "
                        "Bearer header to the Jobs API.",
                        "schema": {"type": ["string", "null"], "format": "password"},
                    },
                    "python": {
                        "label": "Python on the cluster (ray_jobs)",
                        "description": "Interpreter that runs the runtime entrypoint on the head node.",
                        "schema": {"type": ["string", "null"], "default": "python"},
                    },
                },
            }
        ],
    }
