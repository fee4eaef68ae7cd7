"""A ``batchinfer`` connection, parsed once, with one not-found policy.

``ServiceConfig.from_connection`` is the only place that reads the connection's fields: the hook's
``config``, its S3 ``storage_options`` and the Ray Jobs API headers all come from the one object it
returns. No Airflow import: a connection is read through its documented attributes, so the policy
is unit-tested without a metadata DB.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract.url_hosts import parse_url_hosts
from airflow_provider_batchinfer.contract.usage import check_prices
from airflow_provider_batchinfer.launchers import DEFAULT_LAUNCHER, LAUNCHER_NAMES, launcher_class
from airflow_provider_batchinfer.store.s3 import public_options

if TYPE_CHECKING:
    from airflow.sdk import Connection

DEFAULT_CONN_ID = "batchinfer_default"
LLM_ENGINES = ("vllm", "transformers")


class ConnectionNotFoundError(LookupError):
    """A connection id other than ``batchinfer_default`` that does not exist."""


def embedded_home() -> str:
    """Where the embedded default keeps its stage and registry."""
    home = os.environ.get("BATCHINFER_HOME")
    if home:
        return home
    airflow_home = os.environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow")
    return os.path.join(airflow_home, "batchinfer")


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


def _runtime_env(value: Any, conn_id: str) -> dict[str, Any] | None:
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"connection {conn_id!r}: runtime_env must be a JSON object, got {value!r:.80}")
    return value or None


def _idle_seconds(value: Any, conn_id: str) -> float | None:
    """Extra ``local_ray_idle_s``: a number of seconds >= 0, or empty."""
    if value in (None, ""):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not seconds >= 0:
        raise ValueError(
            f"connection {conn_id!r}: local_ray_idle_s must be a number of seconds >= 0 (how long the embedded "
            f"Ray stays up with no job), got {value!r}"
        )
    return seconds


def _catalog_secrets(extra: Mapping[str, Any], stage_root: str, home: str) -> dict[str, str]:
    """The secret properties of the connection's ``iceberg_catalog`` as the runtime's environment. A
    malformed extra gives none here: the task that uses the catalog fails on it with its message."""
    from airflow_provider_batchinfer.store.iceberg.catalog import CatalogError, catalog_config, catalog_secret_env

    if not extra.get("iceberg_catalog"):
        return {}
    try:
        return catalog_secret_env(catalog_config(extra, stage_root, home))
    except CatalogError:
        return {}


@dataclass(frozen=True)
class ServiceConfig:
    """What a connection resolves to. ``to_dict()`` and ``repr()`` hold no secrets, so they may be
    logged; the credentials (``storage_options``) and the Ray headers are kept beside them."""

    stage_root: str
    registry_root: str
    launcher: str = DEFAULT_LAUNCHER
    ray_address: str | None = None
    runtime_env: dict[str, Any] | None = None
    python: str = "python"
    s3: dict[str, Any] = field(default_factory=dict)  # endpoint_url, region: never credentials
    allowed_roots: tuple[str, ...] = ()  # beyond stage_root: where column_handling may read files
    allowed_url_hosts: tuple[str, ...] = ()  # hosts whose http(s) URLs in messages are fetched (none by default)
    llm_engine: str | None = None  # default engine of text_generation jobs: vllm | transformers
    #: local launcher without an address: seconds the shared embedded Ray stays up with no job
    #: (None: ``$BATCHINFER_RAY_IDLE_S``, else 600)
    local_ray_idle_s: float | None = None
    #: S3 settings *with* credentials (see ``s3.py``); never logged, never in a job file
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: HTTP headers for the Ray Jobs API (``Authorization: Bearer <ray_token>``); never logged
    ray_headers: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    #: when the session token in ``storage_options`` expires (None: no token, or not known)
    credential_expiry: datetime | None = field(default=None, compare=False)
    #: the Iceberg catalog's secret properties as ``PYICEBERG_CATALOG__*`` variables: delivered to
    #: the runtime with its credentials, never written down (``store/iceberg/catalog.py``)
    runtime_secrets: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    # extras price_per_cpu_hour / price_per_gpu_hour (currency units per hour): the usage's cost
    prices: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage_root": self.stage_root,
            "registry_root": self.registry_root,
            "launcher": self.launcher,
            "ray_address": self.ray_address,
            "runtime_env": self.runtime_env,
            "python": self.python,
            "s3": dict(self.s3),
            "allowed_roots": list(self.allowed_roots),
            "allowed_url_hosts": list(self.allowed_url_hosts),
            "llm_engine": self.llm_engine,
            "local_ray_idle_s": self.local_ray_idle_s,
            "prices": dict(self.prices),
        }

    @property
    def file_roots(self) -> list[str]:
        """Roots under which model inputs may reference files: the stage root and ``allowed_roots``."""
        return [self.stage_root, *self.allowed_roots]

    @classmethod
    def embedded(cls) -> ServiceConfig:
        """The zero-set-up default: stage and registry under :func:`embedded_home`, a local Ray."""
        home = embedded_home()
        return cls(stage_root=os.path.join(home, "stage"), registry_root=os.path.join(home, "registry"))

    @classmethod
    def from_connection(
        cls,
        conn: Connection | None,
        conn_id: str,
        *,
        get_connection: Callable[[str], Connection] | None = None,
    ) -> ServiceConfig:
        """Parse a ``batchinfer`` connection. ``conn`` None means the id is not defined: for
        ``batchinfer_default`` that is the embedded default, for any other id an error (a typo in a
        DAG must not silently write to the embedded stage). ``get_connection`` resolves the
        ``aws_conn_id`` extra, when there is one."""
        if conn is None:
            if conn_id == DEFAULT_CONN_ID:
                return cls.embedded()
            raise ConnectionNotFoundError(
                f"connection {conn_id!r} is not defined. Create a connection of type 'batchinfer' with that id "
                f"(Admin > Connections, or AIRFLOW_CONN_{conn_id.upper()}), or leave model_service_conn_id at "
                f"{DEFAULT_CONN_ID!r} for the embedded default"
            )
        extra: dict[str, Any] = dict(conn.extra_dejson or {})
        launcher = str(extra.get("launcher") or DEFAULT_LAUNCHER)
        if launcher not in LAUNCHER_NAMES:
            raise ValueError(
                f"connection {conn_id!r}: launcher {launcher!r} is not available; use one of {LAUNCHER_NAMES}"
            )
        address = launcher_class(launcher).check_address(conn.host or extra.get("ray_address") or None, conn_id)
        llm_engine = extra.get("llm_engine") or None
        if llm_engine not in (None, *LLM_ENGINES):
            raise ValueError(
                f"connection {conn_id!r}: llm_engine {llm_engine!r} is not available; use 'vllm', "
                "'transformers' or leave it empty (vLLM exactly when a job asks for GPUs)"
            )
        from airflow_provider_batchinfer.hooks.s3_credentials import EXPIRATION, storage_options_from_connection

        def no_lookup(other: str) -> Connection:
            raise ConnectionNotFoundError(
                f"connection {conn_id!r} names aws_conn_id={other!r}, which cannot be looked up here"
            )

        storage_options = storage_options_from_connection(conn, get_connection or no_lookup)
        expiry = storage_options.pop(EXPIRATION, None)
        headers = {str(k): str(v) for k, v in dict(extra.get("headers") or {}).items()}
        if extra.get("ray_token"):
            headers["Authorization"] = f"Bearer {extra['ray_token']}"
        home = embedded_home()
        return cls(
            stage_root=str(extra.get("stage_root") or os.path.join(home, "stage")),
            registry_root=str(extra.get("registry_root") or os.path.join(home, "registry")),
            launcher=launcher,
            ray_address=address,
            runtime_env=_runtime_env(extra.get("runtime_env"), conn_id),
            python=str(extra.get("python") or "python"),
            s3=public_options(storage_options),
            allowed_roots=_allowed_roots(extra.get("allowed_roots"), conn_id),
            allowed_url_hosts=parse_url_hosts(extra.get("allowed_url_hosts"), f"connection {conn_id!r}", ValueError),
            llm_engine=llm_engine,
            local_ray_idle_s=_idle_seconds(extra.get("local_ray_idle_s"), conn_id),
            storage_options=storage_options,
            ray_headers=headers,
            credential_expiry=expiry,
            runtime_secrets=_catalog_secrets(extra, str(extra.get("stage_root") or ""), home),
            prices=check_prices(extra, f"connection {conn_id!r}", ValueError),
        )
