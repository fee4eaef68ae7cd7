"""The ``batchinfer`` connection form, defined once.

Plain data, no Airflow import: ``get_provider_info`` (which the providers manager reads without
importing any hook) publishes it as ``conn-fields`` / ``ui-field-behaviour``, and
``ModelServiceHook.get_ui_field_behaviour`` returns the same dict in the hook's format, so the two
can no longer drift apart.
"""

from __future__ import annotations

from typing import Any

from airflow_provider_batchinfer.launchers import LAUNCHER_NAMES

CONN_TYPE = "batchinfer"

HIDDEN_FIELDS: tuple[str, ...] = ("schema", "port")

RELABELING: dict[str, str] = {
    "host": "Ray address",
    "login": "AWS access key id (s3:// locations)",
    "password": "AWS secret access key (s3:// locations)",
}

PLACEHOLDERS: dict[str, str] = {
    "host": "local launcher: empty (the shared embedded Ray), 'local' (a private Ray per job) or 127.0.0.1:6379; "
    "ray_jobs: the dashboard, e.g. http://ray-head:8265",
    "login": "empty: use aws_conn_id or the AWS default credential chain (with role_arn: the role is assumed from it)",
    "extra": '{"stage_root": "/data/batchinfer/stage", "registry_root": "/data/batchinfer/registry"}',
}


def _field(label: str, description: str, **schema: Any) -> dict[str, Any]:
    return {"label": label, "description": description, "schema": {"type": ["string", "null"], **schema}}


#: the connection's extras, as Airflow's ``conn-fields`` (label, description, JSON schema)
CONN_FIELDS: dict[str, dict[str, Any]] = {
    "stage_root": _field("Stage root", "Where relative stage locations (outputs, materialized inputs) are placed."),
    "registry_root": _field("Model registry root", "Where logged models live: <root>/<name>/<version>/."),
    "allowed_roots": _field(
        "Allowed file roots",
        "Besides the stage root, where InputSpec.column_handling may read the files a column points at: "
        "comma-separated absolute paths or URIs (s3://bucket/prefix).",
    ),
    "allowed_url_hosts": _field(
        "Allowed URL hosts",
        "Hosts whose http(s) URLs in chat messages (image_url, audio_url, ...) the job fetches: comma-separated "
        "names (cdn.example.com), patterns (*.images.example.com, or * for any public host), IP addresses or CIDR "
        "networks. Empty: no URL is fetched and such rows fail. A pattern never reaches a private, loopback or "
        "link-local address (169.254.169.254, 10.x, ...); name the host or its network to allow one.",
    ),
    "llm_engine": _field(
        "LLM engine",
        "Default engine of text_generation jobs: 'vllm' (GPU, ray.data.llm) or 'transformers' (CPU). "
        "Empty: vLLM exactly when the job asks for GPUs.",
        enum=["vllm", "transformers", None],
    ),
    "local_ray_idle_s": _field(
        "Embedded Ray idle timeout (s)",
        "Local launcher with an empty Ray address: how long the shared embedded Ray stays up after its last "
        "job (default 600, or $BATCHINFER_RAY_IDLE_S).",
    ),
    "endpoint_url": _field(
        "S3 endpoint URL", "For S3-compatible stores (MinIO, R2, ...): e.g. http://minio:9000. Empty: AWS S3."
    ),
    "region_name": _field("S3 region", "Region of the buckets (us-east-1, auto for R2, ...)."),
    "aws_conn_id": _field(
        "AWS connection id", "Take S3 credentials, endpoint and region from this aws connection (fields set here win)."
    ),
    "credentials": _field(
        "Credentials for the job (long jobs)",
        "'connection' (default): the keys above (or the aws_conn_id's) are handed to the Ray driver and workers "
        "as environment values, frozen for the job's life. 'worker': no keys are shipped; every Ray process uses "
        "its own chain (instance profile, IRSA, its environment), which refreshes itself. Temporary keys "
        "(a session token) must outlive the operator's job_timeout, or the task refuses to start the job.",
        enum=["connection", "worker", None],
    ),
    "aws_session_token": _field(
        "AWS session token (temporary keys)",
        "With temporary keys in login/password: their session token. Frozen into the job: prefer role_arn or "
        "credentials: worker for jobs longer than the token's life.",
        format="password",
    ),
    "role_arn": _field(
        "IAM role to assume (long jobs)",
        "e.g. arn:aws:iam::123456789012:role/batch-inference. Every process that opens S3 (the task, the Ray "
        "driver, each worker) assumes this role itself and refreshes the session, so hours-long jobs never hold "
        "an expired token. Base credentials: the keys above when set, else each process's own chain.",
    ),
    "role_session_name": _field(
        "Role session name", "Shown in CloudTrail for the assumed role (default: batchinfer); needs role_arn."
    ),
    "external_id": _field(
        "Role external id", "The ExternalId the role's trust policy requires, if any; needs role_arn."
    ),
    "sts_endpoint_url": _field(
        "STS endpoint URL",
        "Where role_arn is assumed (AWS_ENDPOINT_URL_STS for every Ray process). Empty: the S3 endpoint URL "
        "when set, else AWS STS. Set https://sts.amazonaws.com when the S3 endpoint is not AWS.",
    ),
    "aws_session_expiration": _field(
        "Session token expiry",
        "When the session token expires, ISO 8601 (e.g. 2026-11-23T14:30:00Z). With shipped temporary keys, a "
        "job is started only when this expiry is known and later than its job_timeout (+5 min).",
        format="date-time",
    ),
    # prices for the manifest's usage section (estimated cost) and JobSpec(max_cost=...)
    "price_per_cpu_hour": _field(
        "Price per CPU hour",
        "What one reserved CPU costs per hour (any currency, e.g. 0.048): the manifest's usage then holds an "
        "estimated cost and cost per million rows, and JobSpec(max_cost=...) can stop a job before it overspends.",
    ),
    "price_per_gpu_hour": _field(
        "Price per GPU hour",
        "What one reserved GPU costs per hour, in the same currency (e.g. 2.5). Empty: GPUs are not priced.",
    ),
    # where log_model(..., "mlflow", "models:/...") finds MLflow models
    "mlflow_tracking_uri": _field(
        "MLflow tracking URI",
        "Where log_model(name, version, 'mlflow', 'models:/<name>@<alias>') looks models up, e.g. "
        "http://mlflow:5000. Empty: MLFLOW_TRACKING_URI.",
    ),
    "mlflow_registry_uri": _field(
        "MLflow registry URI",
        "The MLflow model registry when it is not the tracking server. Empty: the tracking URI.",
    ),
    # the Iceberg catalog of OutputSpec(table=...) and iceberg:// inputs
    "iceberg_catalog": {
        "label": "Iceberg catalog",
        "description": 'pyiceberg catalog properties, e.g. {"type": "rest", "uri": "https://catalog:8181"} or '
        '{"type": "sql", "uri": "postgresql+psycopg2://user@db/iceberg", "warehouse": "s3://lake/wh"}. '
        "Empty: a SQL catalog on SQLite under the stage root.",
        "schema": {"type": ["object", "null"]},
    },
    "launcher": _field(
        "Launcher",
        "'local' runs the job as a subprocess of the task with a local or attached Ray; "
        "'ray_jobs' submits it to the Ray Jobs API at the host address.",
        enum=[*LAUNCHER_NAMES, None],
        default="local",
    ),
    "runtime_env": {
        "label": "Ray runtime_env (ray_jobs)",
        "description": 'Defaults for submitted jobs, e.g. {"pip": [...]} or {"image_uri": ...}.',
        "schema": {"type": ["object", "null"]},
    },
    "ray_token": _field(
        "Ray auth token (ray_jobs)",
        "Token of a Ray cluster with token auth (`ray get-auth-token`); sent as a Bearer header to the Jobs API.",
        format="password",
    ),
    "python": _field(
        "Python on the cluster (ray_jobs)",
        "Interpreter that runs the runtime entrypoint on the head node.",
        default="python",
    ),
}


def ui_field_behaviour() -> dict[str, Any]:
    """The form's behaviour as a hook's ``get_ui_field_behaviour`` returns it (snake_case keys)."""
    return {"hidden_fields": list(HIDDEN_FIELDS), "relabeling": dict(RELABELING), "placeholders": dict(PLACEHOLDERS)}


def provider_ui_field_behaviour() -> dict[str, Any]:
    """The same behaviour as ``get_provider_info``'s ``ui-field-behaviour`` (kebab-case keys)."""
    return {"hidden-fields": list(HIDDEN_FIELDS), "relabeling": dict(RELABELING), "placeholders": dict(PLACEHOLDERS)}


def conn_fields() -> dict[str, dict[str, Any]]:
    """A deep-enough copy of :data:`CONN_FIELDS` for ``get_provider_info`` (callers may mutate it)."""
    return {name: {**spec, "schema": dict(spec["schema"])} for name, spec in CONN_FIELDS.items()}
