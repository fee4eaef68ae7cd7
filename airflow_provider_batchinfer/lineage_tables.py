"""OpenLineage datasets for Iceberg tables, used by ``lineage.py``.

A table is named the way OpenLineage's Spark integration names Iceberg tables: by its physical
location per the dataset naming spec (``file`` + absolute path, or ``s3://bucket`` + key), with a
``symlinks`` facet carrying the catalog's name for it (``<namespace>.<table>``, type ``TABLE``), so
a lineage backend joins it with what Spark, Trino or Flink report for the same table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract import Manifest
    from airflow_provider_batchinfer.operators.batch_inference import BatchInferenceOperator


def _symlinks(catalog: dict[str, str], identifier: str) -> Any:
    from openlineage.client.generated.symlinks_dataset import Identifier, SymlinksDatasetFacet

    namespace = catalog.get("uri") or catalog.get("warehouse") or catalog.get("name", "")
    if catalog.get("type") == "sql" and catalog.get("warehouse"):
        namespace = catalog["warehouse"]
    return SymlinksDatasetFacet(identifiers=[Identifier(namespace=namespace, name=identifier, type="TABLE")])


def table_dataset(operator: BatchInferenceOperator, identifier: str, output: bool, manifest: Manifest | None) -> Any:
    """An ``InputDataset``/``OutputDataset`` for ``identifier``, with its statistics once committed."""
    from airflow.providers.common.compat.openlineage.facet import InputDataset, OutputDataset

    from airflow_provider_batchinfer.lineage import dataset_name
    from airflow_provider_batchinfer.tables.catalog import open_catalog, planned_location, public_catalog
    from airflow_provider_batchinfer.tables.read import load_table

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
    else:  # a catalog that picks locations itself, before the table exists
        namespace, name = props.get("uri", "iceberg"), identifier
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


def table_manifest(operator: BatchInferenceOperator, task_instance: Any) -> Manifest | None:
    """The committed run's manifest (from the table's snapshot), or None."""
    from airflow_provider_batchinfer.markers import read_valid_manifest
    from airflow_provider_batchinfer.operators.table_io import run_key
    from airflow_provider_batchinfer.tables.names import run_location

    location = run_location(str(operator.table), run_key(task_instance))
    return read_valid_manifest(location, operator.hook.table_read_options())
