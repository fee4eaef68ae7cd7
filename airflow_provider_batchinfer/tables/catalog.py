"""Which Iceberg catalog a connection means, and opening it with the stage's S3 settings.

- Embedded default (no ``iceberg_catalog`` extra): a SQL catalog on SQLite
  (``<stage root>/_iceberg/catalog.db`` for a local stage root, else
  ``$BATCHINFER_HOME/iceberg/catalog.db``) with its warehouse under ``<stage root>/_iceberg/warehouse``
  (local or ``s3://``): zero set-up, like the rest of the embedded default. It serves jobs that run on
  this machine (the ``local`` launcher); a cluster needs a catalog it can reach.
- Extra ``iceberg_catalog``: pyiceberg catalog properties, e.g. ``{"type": "rest", "uri":
  "https://catalog:8181", "warehouse": "lake"}`` or ``{"type": "sql", "uri":
  "postgresql+psycopg2://...", "warehouse": "s3://lake/warehouse"}`` (``name``: the catalog's name,
  default ``batchinfer``).

Secrets (``token``, ``credential``, passwords, keys) never go into the job file: the runtime gets
them from its environment (pyiceberg reads ``PYICEBERG_CATALOG__<NAME>__<KEY>``; set it through the
connection's ``runtime_env`` extra). An ``s3://`` warehouse uses the stage's S3 settings (endpoint,
region, credentials). Storage layer: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.stage import StageError, is_uri, join

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

DEFAULT_CATALOG_NAME = "batchinfer"
_SECRET_MARKERS = ("token", "credential", "secret", "password", "access-key", "session")


class CatalogError(StageError):
    """The catalog cannot be opened or the table cannot be used; ``permanent`` when no retry helps."""

    def __init__(self, message: str, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


def embedded_catalog(stage_root: str, home: str) -> dict[str, str]:
    """The zero-set-up catalog: SQLite beside (or, for an object-store stage, under ``home``), warehouse
    in the stage."""
    base = join(stage_root, "_iceberg")
    db_dir = base if not is_uri(stage_root) else os.path.join(home, "iceberg")
    warehouse = join(base, "warehouse")
    if not is_uri(warehouse):
        warehouse = "file://" + os.path.abspath(warehouse)
    return {
        "name": DEFAULT_CATALOG_NAME,
        "type": "sql",
        "uri": f"sqlite:///{os.path.abspath(os.path.join(db_dir, 'catalog.db'))}",
        "warehouse": warehouse,
    }


def catalog_config(extra: Mapping[str, Any], stage_root: str, home: str) -> dict[str, str]:
    """The catalog properties a connection's extras name (``iceberg_catalog``), else the embedded one."""
    configured = extra.get("iceberg_catalog")
    if not configured:
        return embedded_catalog(stage_root, home)
    if isinstance(configured, str):
        import json

        try:
            configured = json.loads(configured)
        except ValueError as exc:
            raise CatalogError(f"the connection's iceberg_catalog extra is not a JSON object: {exc}") from exc
    if not isinstance(configured, Mapping) or (not configured.get("type") and not configured.get("uri")):
        raise CatalogError(
            "the connection's iceberg_catalog extra must be an object of pyiceberg catalog properties with a "
            'type, e.g. {"type": "rest", "uri": "https://catalog:8181"} or {"type": "sql", "uri": '
            '"postgresql+psycopg2://...", "warehouse": "s3://lake/warehouse"}'
        )
    out = {str(k): str(v) for k, v in configured.items()}
    out.setdefault("name", DEFAULT_CATALOG_NAME)
    return out


def public_catalog(props: Mapping[str, str]) -> dict[str, str]:
    """What may travel in the job file and manifests: no token, credential, password or key; a
    password inside a database URI is masked."""
    out = {k: v for k, v in props.items() if not any(m in k.lower() for m in _SECRET_MARKERS)}
    uri = out.get("uri", "")
    if "@" in uri and "://" in uri:
        scheme, rest = uri.split("://", 1)
        userinfo, _, host = rest.rpartition("@")
        if ":" in userinfo:
            out["uri"] = f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"
    return out


def io_properties(storage_options: Mapping[str, Any] | None) -> dict[str, str]:
    """pyiceberg FileIO properties from the stage's S3 settings (and, on the runtime side, the
    ``AWS_*`` credentials of this process): an ``s3://`` warehouse reads and writes like the stages."""
    options = dict(storage_options or {})
    env = os.environ
    props = {
        "s3.endpoint": options.get("endpoint_url") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
        "s3.region": options.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        "s3.access-key-id": options.get("access_key") or env.get("AWS_ACCESS_KEY_ID"),
        "s3.secret-access-key": options.get("secret_key") or env.get("AWS_SECRET_ACCESS_KEY"),
        "s3.session-token": options.get("session_token") or env.get("AWS_SESSION_TOKEN"),
    }
    out = {k: str(v) for k, v in props.items() if v}
    if out.get("s3.endpoint", "").startswith("http://"):
        out["s3.force-virtual-addressing"] = "false"
    return out


def open_catalog(props: Mapping[str, str], storage_options: Mapping[str, Any] | None = None) -> Catalog:
    """The catalog ``props`` describe, with FileIO settings for an ``s3://`` warehouse. A local SQLite
    catalog's directory and warehouse are created on first use."""
    from pyiceberg.catalog import load_catalog

    props = dict(props)
    name = props.pop("name", DEFAULT_CATALOG_NAME)
    uri = props.get("uri", "")
    if props.get("type") == "sql" and uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite:///") :]), exist_ok=True)
        warehouse = props.get("warehouse", "")
        if warehouse.startswith("file://"):
            os.makedirs(warehouse[len("file://") :], exist_ok=True)
    props = {**io_properties(storage_options), **props}
    props.setdefault("py-io-impl", "pyiceberg.io.pyarrow.PyArrowFileIO")
    try:
        return load_catalog(name, **props)
    except Exception as exc:
        raise CatalogError(
            f"cannot open the Iceberg catalog {name!r} ({public_catalog(props).get('uri', '')}): "
            f"{type(exc).__name__}: {exc}",
            permanent=False,
        ) from exc


def planned_location(catalog_props: Mapping[str, str], identifier: str) -> str | None:
    """Where a new table will live: ``<warehouse>/<namespace>.db/<table>`` for a SQL catalog with a
    warehouse (what pyiceberg itself would pick); None lets the catalog decide (REST)."""
    warehouse = catalog_props.get("warehouse", "")
    if catalog_props.get("type") != "sql" or not warehouse:
        return None
    namespace, _, table = identifier.rpartition(".")
    return f"{warehouse.rstrip('/')}/{namespace}.db/{table}"
