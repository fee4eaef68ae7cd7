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

What travels in job files, manifests and lineage is an allow-list (:func:`public_catalog`): the
properties named in ``PUBLIC_PROPERTIES``, with URIs redacted (userinfo, and password / token query
parameters). Every other property (``token``, ``credential``, ``header.*``, ``adls.account-key``, a
URI's real value, ...) reaches the runtime through its environment as
``PYICEBERG_CATALOG__<NAME>__<PROP>`` (:func:`catalog_secret_env`), by the same delivery as the
job's S3 credentials (docs/credentials.md), and :func:`open_catalog` reads it back from there. An
``s3://`` warehouse uses the stage's S3 settings (endpoint, region, credentials). Storage layer:
imports neither Airflow nor Ray.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.store.locations import StageError, is_uri, join
from airflow_provider_batchinfer.store.redact import MASK, redact_uri, scrub, uri_secrets

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

DEFAULT_CATALOG_NAME = "batchinfer"
#: pyiceberg catalog properties that hold no secret: these (URIs redacted) may be written down
PUBLIC_PROPERTIES = frozenset(
    {
        "name",
        "type",
        "uri",
        "warehouse",
        "prefix",
        "py-io-impl",
        "scope",
        "audience",
        "resource",
        "oauth2-server-uri",
        "rest.sigv4-enabled",
        "rest.signing-region",
        "rest.signing-name",
        "header.x-iceberg-access-delegation",
        "s3.endpoint",
        "s3.region",
        "s3.path-style-access",
        "s3.force-virtual-addressing",
        "s3.connect-timeout",
        "s3.request-timeout",
        "client.region",
        "gcs.project-id",
        "adls.account-name",
        "glue.region",
        "glue.id",
        "dynamodb.region",
        "dynamodb.endpoint",
        "table-name",
        "init_catalog_tables",
        "echo",
        "pool_pre_ping",
        "downcast-ns-timestamp-to-us-on-write",
    }
)
#: properties whose value is a URI: recorded redacted, delivered whole when redaction changed them
_URI_PROPERTIES = ("uri", "warehouse", "oauth2-server-uri", "s3.endpoint", "dynamodb.endpoint")
_ENV_PREFIX = "PYICEBERG_CATALOG__"
#: how many times a SQL catalog is opened when its creation meets another process's
_OPEN_TRIES = 4
#: what a SQL database says when another process created the catalog's tables first (SQLite and
#: PostgreSQL's ``already exists``, PostgreSQL's duplicate row in ``pg_type`` for a table's type)
_CREATED_ELSEWHERE = ("already exists", "duplicate key value")


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
    """What may travel in the job file, manifests and lineage: only ``PUBLIC_PROPERTIES`` (an
    allow-list: a property nobody thought of stays out), each URI without its credentials."""
    out = {k: v for k, v in props.items() if k.lower() in PUBLIC_PROPERTIES}
    for key in _URI_PROPERTIES:
        if out.get(key):
            out[key] = redact_uri(out[key])
    return out


def _env_name(catalog: str, prop: str) -> str:
    """pyiceberg's own environment spelling: ``.`` is ``__``, ``-`` is ``_``, case does not matter."""
    return f"{_ENV_PREFIX}{catalog.upper()}__{prop.upper().replace('.', '__').replace('-', '_')}"


def catalog_secret_env(props: Mapping[str, str]) -> dict[str, str]:
    """``PYICEBERG_CATALOG__<NAME>__<PROP>`` for every property :func:`public_catalog` leaves out or
    redacts: how the runtime gets them without a file. Property names are read back lower-case with
    ``-`` for ``_`` (as pyiceberg reads them), which HTTP headers and pyiceberg's own names survive."""
    name = props.get("name", DEFAULT_CATALOG_NAME)
    public = public_catalog(props)
    return {_env_name(name, k): str(v) for k, v in props.items() if k != "name" and public.get(k) != v}


def catalog_env_properties(name: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The properties of catalog ``name`` that its environment holds (:func:`catalog_secret_env`'s
    variables, or ones set on the nodes by hand), decoded as pyiceberg decodes them."""
    wanted = name.lower().replace("_", "-")
    out = {}
    for var, value in environ.items():
        if not var.upper().startswith(_ENV_PREFIX):
            continue
        catalog, _, prop = var[len(_ENV_PREFIX) :].lower().partition("__")
        if prop and catalog.replace("_", "-") == wanted:
            out[".".join(part.replace("_", "-") for part in prop.split("__"))] = value
    return out


def catalog_secrets(props: Mapping[str, str]) -> list[str]:
    """Every secret value ``props`` hold: the ones :func:`public_catalog` leaves out or redacts, and
    the credential parts of URIs (error texts that echo a URI are scrubbed of them)."""
    found = list(catalog_secret_env(props).values())
    for key in _URI_PROPERTIES:
        found.extend(uri_secrets(props.get(key, "")))
    return found


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
    """The catalog ``props`` describe, with FileIO settings for an ``s3://`` warehouse and the
    properties this process's environment delivers (:func:`catalog_env_properties`: they fill in what
    the job file leaves out and replace what it redacts). A local SQLite catalog's directory and
    warehouse are created on first use, and two processes that create the same catalog at once both
    open it (:func:`_creation_lock`). An error names the catalog by its redacted URI and holds no
    secret value."""
    from pyiceberg.catalog import load_catalog

    props = dict(props)
    name = props.pop("name", DEFAULT_CATALOG_NAME)
    delivered = catalog_env_properties(name, os.environ)
    props.update({k: v for k, v in delivered.items() if k not in props or MASK in props[k]})
    uri = props.get("uri", "")
    sqlite_file = None
    if props.get("type") == "sql" and uri.startswith("sqlite:///"):
        sqlite_file = uri[len("sqlite:///") :].split("?", 1)[0]
        os.makedirs(os.path.dirname(sqlite_file), exist_ok=True)
        warehouse = props.get("warehouse", "")
        if warehouse.startswith("file://"):
            os.makedirs(warehouse[len("file://") :], exist_ok=True)
    props = {**io_properties(storage_options), **props}
    props.setdefault("py-io-impl", "pyiceberg.io.pyarrow.PyArrowFileIO")
    try:
        with _creation_lock(sqlite_file):
            tries = 1
            while True:
                try:
                    return load_catalog(name, **props)
                except Exception as exc:
                    if tries >= _OPEN_TRIES or props.get("type") != "sql" or not _created_elsewhere(exc):
                        raise
                    tries += 1
    except Exception as exc:
        secrets = [*catalog_secrets({**props, "name": name}), *(str(v) for k, v in props.items() if "key" in k)]
        raise CatalogError(
            scrub(
                f"cannot open the Iceberg catalog {name!r} ({public_catalog(props).get('uri', '')}): "
                f"{type(exc).__name__}: {exc}",
                secrets,
            ),
            permanent=False,
        ) from exc


@contextmanager
def _creation_lock(sqlite_file: str | None) -> Iterator[None]:
    """Hold an exclusive lock on ``<SQLite file>.lock`` while the catalog is opened: pyiceberg's
    SQL catalog creates its tables when it finds none, and two processes opening a new catalog at
    once would both create them. Only opening is serialized (milliseconds); what is done with the
    catalog afterwards is not. Without a SQLite file, or where the lock file cannot be made (a
    read-only directory), nothing is locked and :func:`open_catalog` opens the catalog again when
    its creation meets another process's (:data:`_CREATED_ELSEWHERE`)."""
    if sqlite_file is None or sqlite_file in ("", ":memory:"):
        yield
        return
    import fcntl

    try:
        handle = open(sqlite_file + ".lock", "a")
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # the lock goes with the closed file


def _created_elsewhere(exc: BaseException) -> bool:
    """Whether opening a SQL catalog failed because another process created its tables first:
    opening it again finds them."""
    text = str(exc).lower()
    return any(phrase in text for phrase in _CREATED_ELSEWHERE)


def planned_location(catalog_props: Mapping[str, str], identifier: str) -> str | None:
    """Where a new table will live: ``<warehouse>/<namespace>.db/<table>`` for a SQL catalog with a
    warehouse (what pyiceberg itself would pick); None lets the catalog decide (REST)."""
    warehouse = catalog_props.get("warehouse", "")
    if catalog_props.get("type") != "sql" or not warehouse:
        return None
    namespace, _, table = identifier.rpartition(".")
    return f"{warehouse.rstrip('/')}/{namespace}.db/{table}"
