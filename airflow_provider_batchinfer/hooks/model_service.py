"""ModelServiceHook: the model registry and the compute, behind one Airflow connection.

The connection (type ``batchinfer``) says where stages and the registry live and how jobs are
launched. ``batchinfer_default`` need not exist: without it the hook uses the embedded default
(``$BATCHINFER_HOME``, else ``$AIRFLOW_HOME/batchinfer``, with a local Ray), so a new user's first
DAG runs with zero set-up.
"""

from __future__ import annotations

from datetime import datetime, timezone
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowNotFoundException

from airflow_provider_batchinfer.hooks.connection_fields import ui_field_behaviour
from airflow_provider_batchinfer.hooks.s3_credentials import credential_lifetime_problem
from airflow_provider_batchinfer.hooks.service_config import (
    DEFAULT_CONN_ID,
    ConnectionNotFoundError,
    ServiceConfig,
    embedded_home,
)
from airflow_provider_batchinfer.launchers import LAUNCHER_NAMES, launcher_class
from airflow_provider_batchinfer.registry import ModelRegistry, ModelVersion, verify_local_copy
from airflow_provider_batchinfer.store.committed import read_committed
from airflow_provider_batchinfer.store.locations import resolve_location
from airflow_provider_batchinfer.store.s3 import DEFAULT_MAX_ATTEMPTS, credential_env, public_options
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    from airflow.sdk import Connection

    from airflow_provider_batchinfer.launchers.base import Launcher
    from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher

LAUNCHERS = LAUNCHER_NAMES  # kept for imports from 0.1.0
__all__ = ["LAUNCHERS", "ModelServiceHook", "ServiceConfig", "embedded_home"]


class ModelServiceHook(BaseHook):
    """Registry (log, resolve and verify model versions) and launcher for batch inference jobs.

    :param model_service_conn_id: a ``batchinfer`` connection. Host: an existing Ray cluster's
        address for the local launcher to attach to (empty: a local Ray per job). Extras:
        ``stage_root``, ``registry_root``, ``launcher``, ``allowed_roots`` (where
        ``InputSpec.column_handling`` may read files besides the stage root), ``llm_engine``
        (``vllm`` | ``transformers``: the default engine of text_generation jobs). For ``s3://`` locations: login/password
        (access key id / secret), extras ``endpoint_url``, ``region_name``, or ``aws_conn_id``; for long jobs
        ``role_arn`` (+ ``role_session_name``, ``external_id``, ``sts_endpoint_url``) or ``credentials: worker``,
        and ``aws_session_expiration`` for a session token (see docs/credentials.md).
    """

    conn_name_attr = "model_service_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "batchinfer"
    hook_name = "Batch Inference Model Service"

    def __init__(self, model_service_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_service_conn_id = model_service_conn_id

    def _connection(self) -> Connection | None:
        try:
            return self.get_connection(self.model_service_conn_id)
        except AirflowNotFoundException:
            return None

    @cached_property
    def config(self) -> ServiceConfig:
        """The connection, parsed once (:meth:`ServiceConfig.from_connection`): an absent
        ``batchinfer_default`` is the embedded default, any other absent id an error."""
        conn = self._connection()
        try:
            config = ServiceConfig.from_connection(conn, self.model_service_conn_id, get_connection=self.get_connection)
        except ConnectionNotFoundError as exc:
            raise AirflowNotFoundException(str(exc)) from exc
        if conn is None:
            self.log.info(
                "No %s connection: using the embedded default under %s with a local Ray",
                self.default_conn_name,
                embedded_home(),
            )
        return config

    @property
    def storage_options(self) -> dict[str, Any]:
        """S3 settings and credentials for ``s3://`` stages, inputs and registries (see ``s3.py``).

        Held in memory only: the job spec gets :meth:`runtime_storage_options`, the runtime
        subprocess :meth:`runtime_env`. Without any setting, pyarrow's AWS default chain applies.
        """
        return dict(self.config.storage_options)

    def runtime_storage_options(self) -> dict[str, Any]:
        """What the job spec may carry: endpoint, region, retry settings; no credentials."""
        return {"max_attempts": DEFAULT_MAX_ATTEMPTS, **public_options(self.storage_options)}

    def runtime_env(self) -> dict[str, str]:
        """``AWS_*`` variables for the runtime subprocess: how credentials reach it without a file
        (none with the extra ``credentials: worker``)."""
        return credential_env(self.storage_options)

    def check_credential_lifetime(self, job_timeout: float | None) -> None:
        """Refuse, before any work, a job whose shipped S3 credentials are temporary and cannot be
        shown to last until its deadline (``job_timeout`` seconds from now, plus a margin): they are
        frozen into the job's environment, so they would expire mid-job and fail it hours in.
        Permanent keys, ``credentials: worker`` and a role assumed from the workers' own chain pass.

        :raises AirflowFailException: naming the expiry and how to fix the connection.
        """
        problem = credential_lifetime_problem(
            self.storage_options,
            self.config.credential_expiry,
            job_timeout,
            datetime.now(timezone.utc),
            self.model_service_conn_id,
        )
        if problem:
            raise AirflowFailException(problem)

    def open_stage(self, location: str) -> Stage:
        """A location (relative ones under ``stage_root``) with this connection's S3 settings."""
        return Stage.open(self.resolve_location(location), self.storage_options)

    def read_committed(self, manifest: dict[str, Any], columns: list[str] | None = None) -> Any:
        """What a ``publish`` task should read: only the files ``manifest`` (a ``_SUCCESS``, e.g. the
        sensor's XCom) commits, as a ``pyarrow.Table``, with this connection's S3 settings. For a run
        committed into an Iceberg table: exactly its rows, in the snapshot that committed them."""
        if manifest.get("table") if isinstance(manifest, dict) else getattr(manifest, "table", None):
            return read_committed(manifest, self.table_read_options(), columns)
        return read_committed(manifest, self.storage_options, columns)

    def catalog_properties(self) -> dict[str, str]:
        """The connection's Iceberg catalog (extra ``iceberg_catalog``), else the embedded SQLite one;
        AirflowFailException when the connection's catalog is not usable."""
        from airflow_provider_batchinfer.hooks.service_config import embedded_home
        from airflow_provider_batchinfer.store.iceberg.catalog import CatalogError, catalog_config

        conn = self._connection()
        extra = dict(conn.extra_dejson or {}) if conn is not None else {}
        try:
            return catalog_config(extra, self.config.stage_root, embedded_home())
        except CatalogError as exc:
            failure = AirflowFailException if getattr(exc, "permanent", True) else AirflowException
            raise failure(str(exc)) from exc

    def table_read_options(self) -> dict[str, Any]:
        """What readers of ``iceberg://`` locations take: the S3 settings, the catalog, and the roots
        below which they may read what a snapshot summary or a manifest names (``tables.read``)."""
        from airflow_provider_batchinfer.store.iceberg.read import CATALOG_OPTION, ROOTS_OPTION, read_roots

        catalog = self.catalog_properties()
        roots = read_roots(self.config.stage_root, self.config.registry_root, catalog)
        return {**self.storage_options, CATALOG_OPTION: catalog, ROOTS_OPTION: roots}

    @cached_property
    def registry(self) -> ModelRegistry:
        return ModelRegistry(self.config.registry_root, self.storage_options)

    # --- models ----------------------------------------------------------------------------------------
    def log_model(
        self, name: str, version: str | None, flavor: str, artifact: Any = None, **kwargs: Any
    ) -> ModelVersion:
        """Log an immutable model version; see :meth:`ModelRegistry.log_model` for the arguments.

        ``flavor="mlflow"`` copies the MLflow model ``artifact`` (``models:/<name>/<version>``,
        ``models:/<name>@<alias>``, ``runs:/<run id>/<path>``) from the tracking server given by
        ``tracking_uri=``, else the connection extra ``mlflow_tracking_uri`` (and
        ``mlflow_registry_uri``), else ``MLFLOW_TRACKING_URI``."""
        if flavor == "mlflow":
            conn = self._connection()
            extra = dict(conn.extra_dejson or {}) if conn is not None else {}
            for option in ("tracking_uri", "registry_uri"):
                if kwargs.get(option) is None and extra.get(f"mlflow_{option}"):
                    kwargs[option] = str(extra[f"mlflow_{option}"])
        mv = self.registry.log_model(name, version, flavor, artifact, **kwargs)
        self.log.info(
            "Model %s/%s (%s) is in the registry at %s, sha256 %s", mv.name, mv.version, mv.flavor, mv.uri, mv.sha256
        )
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

    def get_launcher(self) -> Launcher:
        """The launcher the connection names (``launchers.LAUNCHERS``), configured from it."""
        return launcher_class(self.config.launcher).from_config(self.config)

    def get_ray_jobs_launcher(self) -> RayJobsLauncher:
        """The Jobs API client for this connection, whatever its ``launcher`` (the trigger uses it).
        The cluster token (extra ``ray_token``) goes into the request headers only; it never
        reaches the job spec, the logs or XCom."""
        from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher

        return RayJobsLauncher.from_config(self.config)

    def test_connection(self) -> tuple[bool, str]:
        """Used by the UI's Test button: the stage and registry roots must be reachable and writable."""
        try:
            cfg = self.config
            for root in (cfg.stage_root, cfg.registry_root):
                probe = self.open_stage(root).child(".batchinfer-connection-test")
                probe.write_bytes(b"ok")
                probe.delete()
            return True, f"stage_root {cfg.stage_root} and registry_root {cfg.registry_root} are writable"
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """The form's behaviour, from the one definition ``get_provider_info`` publishes too."""
        return ui_field_behaviour()
