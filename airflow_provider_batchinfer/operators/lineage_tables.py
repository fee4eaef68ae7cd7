"""OpenLineage datasets, used by ``lineage.py``: how a location and an Iceberg table are named, and
what lineage reads of the operator (:class:`LineageSource`).

A table is named the way OpenLineage's Spark integration names Iceberg tables: by its physical
location per the dataset naming spec (``file`` + absolute path, or ``s3://bucket`` + key), with a
``symlinks`` facet carrying the catalog's name for it (``<namespace>.<table>``, type ``TABLE``), so
a lineage backend joins it with what Spark, Trino or Flink report for the same table.

The catalog itself appears in lineage only as :func:`catalog_namespace`: its URI's scheme, host,
port and path. A catalog URI often carries a database password or a token (``postgresql://user:
password@host/db``, ``?token=``); lineage events go to a backend that every reader of lineage
can query, so no userinfo and no query string reaches them, whichever path names the table (a
committed location, a planned one, or the catalog alone when the table does not exist yet or the
catalog cannot be reached).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from airflow_provider_batchinfer.store.s3 import is_s3, split_uri

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract import Manifest
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook


#: the namespace of a table named by its catalog when the catalog has no usable URI
UNNAMED_CATALOG = "iceberg"


class LineageSource(Protocol):
    """What lineage reads of the operator: its rendered fields, its hook and its run directory. The
    operator satisfies it; lineage names this, not the operator class that mixes lineage in."""

    model: str
    version: str
    input: str | list[str] | None
    sql: str | None
    conn_id: str | None
    stage_location: str | None
    table: str | None

    @property
    def hook(self) -> ModelServiceHook: ...

    def resolve_run_directory(self, context: Any) -> str: ...


def dataset_name(location: str) -> tuple[str, str]:
    """``(namespace, name)`` of a location, per OpenLineage's dataset naming spec."""
    from openlineage.client.naming.dataset import S3, LocalFileSystem

    if is_s3(location):
        bucket, key = split_uri(location)
        naming: Any = S3(bucket_name=bucket, object_key=key or "/")
    else:
        path = location[len("file://") :] if location.startswith("file://") else location
        naming = LocalFileSystem(path=os.path.normpath(os.path.abspath(path)))
    return naming.get_namespace(), naming.get_name()


def catalog_namespace(uri: str) -> str:
    """A catalog URI as lineage may carry it: ``scheme://host[:port]/path``, without userinfo (a
    user name, password or bare token) and without query or fragment (where tokens and passwords
    go as parameters). Built from what is kept rather than by removing what is known to be secret,
    so a credential in an unforeseen parameter stays out too. A plain path is kept as it is; a URI
    that does not parse is :data:`UNNAMED_CATALOG`."""
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError:
        return UNNAMED_CATALOG
    if not parts.scheme:
        return parts.path or UNNAMED_CATALOG
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    named = f"{parts.scheme}://{netloc}{parts.path}"
    return named if "@" not in named else UNNAMED_CATALOG  # ``user:pw@host`` without a scheme


def _symlinks(catalog: Mapping[str, str], identifier: str) -> Any:
    """The catalog's name for the table; the catalog named by its warehouse (a SQL catalog) or its
    URI (:func:`catalog_namespace`)."""
    from openlineage.client.generated.symlinks_dataset import Identifier, SymlinksDatasetFacet

    if catalog.get("uri"):
        namespace = catalog_namespace(catalog["uri"])
    else:
        namespace = catalog.get("warehouse") or catalog.get("name", UNNAMED_CATALOG)
    if catalog.get("type") == "sql" and catalog.get("warehouse"):
        namespace = catalog_namespace(catalog["warehouse"])
    return SymlinksDatasetFacet(identifiers=[Identifier(namespace=namespace, name=identifier, type="TABLE")])


def table_dataset(operator: LineageSource, identifier: str, output: bool, manifest: Manifest | None) -> Any:
    """An ``InputDataset``/``OutputDataset`` for ``identifier``, with its statistics once committed."""
    from airflow.providers.common.compat.openlineage.facet import InputDataset, OutputDataset

    from airflow_provider_batchinfer.store.iceberg.catalog import open_catalog, planned_location, public_catalog
    from airflow_provider_batchinfer.store.iceberg.read import load_table

    props = operator.hook.catalog_properties()
    location = manifest.table.location if output and manifest is not None and manifest.table else ""
    if not location:
        try:
            table = load_table(open_catalog(props, operator.hook.storage_options), identifier)
        except Exception:  # lineage must never fail the task
            table = None
        location = table.location() if table is not None else planned_location(props, identifier) or ""
    if location:
        namespace, name = dataset_name(location)
    else:  # a catalog that picks locations itself, before the table exists (or cannot be reached)
        namespace, name = catalog_namespace(props.get("uri", "")), identifier
    facets = {"symlinks": _symlinks(public_catalog(props), identifier)}
    if not output:
        return InputDataset(namespace=namespace, name=name, facets=facets)
    output_facets: dict[str, Any] = {}
    if manifest is not None:
        from openlineage.client.generated.output_statistics_output_dataset import OutputStatisticsOutputDatasetFacet

        output_facets["outputStatistics"] = OutputStatisticsOutputDatasetFacet(
            rowCount=manifest.counts.output_rows,
            size=sum(f.size for f in manifest.files),
            fileCount=len(manifest.files),
        )
    return OutputDataset(namespace=namespace, name=name, facets=facets, outputFacets=output_facets)


def table_manifest(operator: LineageSource, task_instance: Any) -> Manifest | None:
    """The committed run's manifest (from the table's snapshot), or None."""
    from airflow_provider_batchinfer.contract.specs.tables import run_location
    from airflow_provider_batchinfer.operators.table_io import run_key
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    location = run_location(str(operator.table), run_key(task_instance))
    return read_valid_manifest(location, operator.hook.table_read_options())
