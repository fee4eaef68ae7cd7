"""ModelServiceHook: the model registry and the compute, behind one Airflow connection.

The connection (type ``batchinfer``) says where stages and the registry live and how jobs are
launched. ``batchinfer_default`` need not exist: without it the hook uses the embedded default
(``$BATCHINFER_HOME``, else ``$AIRFLOW_HOME/batchinfer``, with a local Ray), so a new user's first
DAG runs with zero set-up.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_batchinfer.launchers.local import LocalLauncher
from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher
from airflow_provider_batchinfer.registry import ModelRegistry, ModelVersion, verify_local_copy
from airflow_provider_batchinfer.s3 import DEFAULT_MAX_ATTEMPTS, credential_env, public_options
from airflow_provider_batchinfer.stage import Stage, read_committed, resolve_location

LAUNCHERS = ("local", "ray_jobs")


@dataclass(frozen=True)
class ServiceConfig:
    """What a connection resolves to; never holds secrets, so it may be logged."""

    stage_root: str
    registry_root: str
    launcher: str = "local"
    ray_address: str | None = None
    runtime_env: dict[str, Any] | None = None
    python: str = "python"
    s3: dict[str, Any] = field(default_factory=dict)  # endpoint_url, region: never credentials
    allowed_roots: tuple[str, ...] = ()  # beyond stage_root: where column_handling may read files
    llm_engine: str | None = None  # default engine of text_generation jobs: vllm | transformers

    def to_dict(self) -> dict[str, Any]:
        return {"stage_root": self.stage_root, "registry_root": self.registry_root,
                "launcher": self.launcher, "ray_address": self.ray_address,
                "runtime_env": self.runtime_env, "python": self.python, "s3": dict(self.s3),
                "allowed_roots": list(self.allowed_roots), "llm_engine": self.llm_engine}

    @property
    def file_roots(self) -> list[str]:
        """Roots under which model inputs may reference files: the stage root and ``allowed_roots``."""
        return [self.stage_root, *self.allowed_roots]


def _allowed_roots(value: Any, conn_id: str) -> tuple[str, ...]:
    """Extra ``allowed_roots``: a JSON list or a comma-separated string of absolute paths / URIs."""
    if not value:
        return ()
    if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith("[") else [v.strip() for v in value.split(",")]
    roots = tuple(str(v).rstrip("/") for v in value if str(v).strip())
    for root in roots:
        if not (root.startswith("/") or "://" in root) or ".." in root.split("/"):
            raise ValueError(
                f"connection {conn_id!r}: allowed_roots entry {root!r} must be an absolute path or a URI such as "
                "s3://bucket/prefix, without '..'"
            )
    return roots


def embedded_home() -> str:
    home = os.environ.get("BATCHINFER_HOME")
    if home:
        return home
    airflow_home = os.environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow")
    return os.path.join(airflow_home, "batchinfer")


class ModelServiceHook(BaseHook):
    """Registry (log, resolve and verify model versions) and launcher for batch inference jobs.

    :param model_service_conn_id: a ``batchinfer`` connection. Host: an existing Ray cluster's
        address for the local launcher to attach to (empty: a local Ray per job). Extras:
        ``stage_root``, ``registry_root``, ``launcher``, ``allowed_roots`` (where
        ``InputSpec.column_handling`` may read files besides the stage root), ``llm_engine``
        (``vllm`` | ``transformers``: the default engine of text_generation jobs). For ``s3://`` locations: login/password
        (access key id / secret), extras ``endpoint_url``, ``region_name``, or ``aws_conn_id``.
    """

    conn_name_attr = "model_service_conn_id"
    default_conn_name = "batchinfer_default"
    conn_type = "batchinfer"
    hook_name = "Batch Inference Model Service"

    def __init__(self, model_service_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_service_conn_id = model_service_conn_id

    @cached_property
    def config(self) -> ServiceConfig:
        try:
            conn = self.get_connection(self.model_service_conn_id)
        except AirflowNotFoundException:
            if self.model_service_conn_id != self.default_conn_name:
                raise
            home = embedded_home()
            self.log.info("No %s connection: using the embedded default under %s with a local Ray",
                          self.default_conn_name, home)
            return ServiceConfig(stage_root=os.path.join(home, "stage"), registry_root=os.path.join(home, "registry"))
        extra = conn.extra_dejson
        home = embedded_home()
        launcher = extra.get("launcher") or "local"
        if launcher not in LAUNCHERS:
            raise ValueError(
                f"connection {self.model_service_conn_id!r}: launcher {launcher!r} is not available; use one of {LAUNCHERS}"
            )
        address = conn.host or extra.get("ray_address") or None
        if launcher == "ray_jobs" and not address:
            raise ValueError(
                f"connection {self.model_service_conn_id!r}: the ray_jobs launcher needs the Ray dashboard address "
                "in the host field, e.g. http://ray-head:8265"
            )
        if launcher == "ray_jobs" and "://" not in address:
            address = f"http://{address}"
        llm_engine = extra.get("llm_engine") or None
        if llm_engine not in (None, "vllm", "transformers"):
            raise ValueError(
                f"connection {self.model_service_conn_id!r}: llm_engine {llm_engine!r} is not available; use 'vllm', "
                "'transformers' or leave it empty (vLLM exactly when a job asks for GPUs)"
            )
        runtime_env = extra.get("runtime_env")
        if isinstance(runtime_env, str):
            runtime_env = json.loads(runtime_env) if runtime_env.strip() else None
        return ServiceConfig(
            stage_root=str(extra.get("stage_root") or os.path.join(home, "stage")),
            registry_root=str(extra.get("registry_root") or os.path.join(home, "registry")),
            launcher=launcher,
            ray_address=address,
            runtime_env=runtime_env,
            python=str(extra.get("python") or "python"),
            s3=public_options(self.storage_options),
            allowed_roots=_allowed_roots(extra.get("allowed_roots"), self.model_service_conn_id),
            llm_engine=llm_engine,
        )

    @cached_property
    def storage_options(self) -> dict[str, Any]:
        """S3 settings and credentials for ``s3://`` stages, inputs and registries (see ``s3.py``).

        Held in memory only: the job spec gets :meth:`runtime_storage_options`, the runtime
        subprocess :meth:`runtime_env`. Without any setting, pyarrow's AWS default chain applies.
        """
        from airflow_provider_batchinfer.hooks.s3_credentials import storage_options_from_connection

        try:
            conn = self.get_connection(self.model_service_conn_id)
        except AirflowNotFoundException:
            if self.model_service_conn_id != self.default_conn_name:
                raise
            return {}
        return storage_options_from_connection(conn, self.get_connection)

    def runtime_storage_options(self) -> dict[str, Any]:
        """What the job spec may carry: endpoint, region, retry settings; no credentials."""
        return {"max_attempts": DEFAULT_MAX_ATTEMPTS, **public_options(self.storage_options)}

    def runtime_env(self) -> dict[str, str]:
        """``AWS_*`` variables for the runtime subprocess: how credentials reach it without a file."""
        return credential_env(self.storage_options)

    def open_stage(self, location: str) -> Stage:
        """A location (relative ones under ``stage_root``) with this connection's S3 settings."""
        return Stage.open(self.resolve_location(location), self.storage_options)

    def read_committed(self, manifest: dict[str, Any], columns: list[str] | None = None) -> Any:
        """What a ``publish`` task should read: only the files ``manifest`` (a ``_SUCCESS``, e.g. the
        sensor's XCom) commits, as a ``pyarrow.Table``, with this connection's S3 settings."""
        return read_committed(manifest, self.storage_options, columns)

    @cached_property
    def registry(self) -> ModelRegistry:
        return ModelRegistry(self.config.registry_root, self.storage_options)

    # --- models ----------------------------------------------------------------------------------------
    def log_model(self, name: str, version: str | None, flavor: str, artifact: Any = None, **kwargs: Any) -> ModelVersion:
        """Log an immutable model version; see :meth:`ModelRegistry.log_model` for the arguments."""
        mv = self.registry.log_model(name, version, flavor, artifact, **kwargs)
        self.log.info("Model %s/%s (%s) is in the registry at %s, sha256 %s", mv.name, mv.version, mv.flavor, mv.uri, mv.sha256)
        return mv

    def get_model(self, name: str, version: str, verify: bool = True) -> ModelVersion:
        """Resolve a version and (by default) check it, so a tampered model fails the task before any
        compute is requested: a local registry's files are re-hashed; an object-store version is
        checked against its manifest by listing (files, sizes, digest) and never downloaded onto the
        Airflow worker; each Ray actor downloads and re-hashes it on its own node before loading."""
        mv = self.registry.get(name, version)
        if verify and self.registry.is_local:
            verify_local_copy(self.registry.local_copy(name, version), mv.sha256)
        elif verify:
            self.registry.check_listing(name, version, mv.sha256)
        return mv

    # --- stages and compute ------------------------------------------------------------------------------
    def resolve_location(self, location: str) -> str:
        return resolve_location(location, self.config.stage_root)

    def get_launcher(self) -> LocalLauncher | RayJobsLauncher:
        if self.config.launcher == "ray_jobs":
            return self.get_ray_jobs_launcher()
        return LocalLauncher(ray_address=self.config.ray_address)

    def get_ray_jobs_launcher(self) -> RayJobsLauncher:
        """The Jobs API client for this connection. The cluster token (extra ``ray_token``) goes into
        the request headers only; it never reaches the job spec, the logs or XCom."""
        runtime_env = dict(self.config.runtime_env or {})
        credentials = self.runtime_env()
        if credentials:  # S3 credentials for the job driver and its workers, as for the local launcher
            runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **credentials}
        return RayJobsLauncher(
            address=self.config.ray_address or "",
            headers=self._ray_headers(),
            runtime_env=runtime_env or None,
            python=self.config.python,
        )

    def _ray_headers(self) -> dict[str, str]:
        try:
            conn = self.get_connection(self.model_service_conn_id)
        except AirflowNotFoundException:
            return {}
        headers = dict(conn.extra_dejson.get("headers") or {})
        token = conn.extra_dejson.get("ray_token")
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def test_connection(self) -> tuple[bool, str]:
        """Used by the UI's Test button: the stage and registry roots must be reachable and writable."""
        try:
            cfg = self.config
            for what, root in (("stage_root", cfg.stage_root), ("registry_root", cfg.registry_root)):
                probe = self.open_stage(root).child(".batchinfer-connection-test")
                probe.write_bytes(b"ok")
                probe.delete()
            return True, f"stage_root {cfg.stage_root} and registry_root {cfg.registry_root} are writable"
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema", "port"],
            "relabeling": {"host": "Ray address", "login": "AWS access key id (s3://)",
                           "password": "AWS secret access key (s3://)"},
            "placeholders": {"host": "local: empty or 127.0.0.1:6379; ray_jobs: http://ray-head:8265",
                             "login": "empty: aws_conn_id or the AWS default chain"},
        }

