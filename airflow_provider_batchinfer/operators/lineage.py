"""OpenLineage metadata of a batch inference task: what it read, what it wrote, with which model.

Airflow's OpenLineage provider calls ``get_openlineage_facets_on_start`` /
``..._on_complete`` / ``..._on_failure`` of an operator when it is installed and configured; the
operator's methods (:class:`OpenLineageMethods`, mixed into it) delegate here. Everything OpenLineage is imported inside the functions, so the
provider works (and parses DAG files) without it.

What a lineage backend (Marquez, DataHub, ...) gets:

- inputs: each input location (Parquet file or directory; for ``sql=`` the tables the query reads,
  when the connection's hook describes its database to OpenLineage), and the model version's
  directory in the registry, which is as much an input of the predictions as the table;
- output: the run directory, with its schema (the Parquet footer of a committed file; before the
  run, the model signature's outputs) and its statistics (rows, bytes, files from ``_SUCCESS``);
- a ``batchinference`` run facet: model name, version, flavor and sha256, the job id, attempt,
  launcher, row counts and timings.

Dataset names follow the OpenLineage naming spec: a local path is namespace ``file`` with the
absolute path as the name; ``s3://bucket/key`` is namespace ``s3://bucket`` with ``key`` as the name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract.specs.tables import is_table_input, parse_table_input
from airflow_provider_batchinfer.operators.lineage_tables import (
    LineageSource,
    dataset_name,
    table_dataset,
    table_manifest,
)
from airflow_provider_batchinfer.registry import RegistryError
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.locations import join
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

    from airflow_provider_batchinfer.contract import Manifest

RUN_FACET = "batchinference"
# the facet's JSON schema ships in docs/openlineage/BatchInferenceRunFacet.json
FACET_SCHEMA_URL = "https://pypi.org/project/airflow-provider-batchinfer/#/$defs/BatchInferenceRunFacet"


def _run_facet_class() -> type:
    """A custom run facet (defined on first use: its base class comes from the OpenLineage client)."""
    global _RUN_FACET_CLASS
    if _RUN_FACET_CLASS is None:
        import attr
        from openlineage.client.generated.base import RunFacet

        @attr.define
        class BatchInferenceRunFacet(RunFacet):
            """The model and the job behind a run's predictions."""

            model: dict[str, Any]
            job: dict[str, Any] = attr.field(factory=dict)
            counts: dict[str, Any] = attr.field(factory=dict)
            timings: dict[str, Any] = attr.field(factory=dict)
            usage: dict[str, Any] = attr.field(factory=dict)  # held, rows/s, latency, tokens, cost

            @staticmethod
            def _get_schema() -> str:
                return FACET_SCHEMA_URL

        _RUN_FACET_CLASS = BatchInferenceRunFacet
    return _RUN_FACET_CLASS


_RUN_FACET_CLASS: type | None = None


def _schema_facet(fields: list[tuple[str, str]]) -> Any:
    from airflow.providers.common.compat.openlineage.facet import SchemaDatasetFacet, SchemaDatasetFacetFields

    return SchemaDatasetFacet(fields=[SchemaDatasetFacetFields(name=n, type=t) for n, t in fields])


def _parquet_fields(location: str, storage_options: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Column names and Arrow types from one Parquet footer (no data is read)."""
    import pyarrow.parquet as pq

    stage = Stage.open(location, storage_options)
    schema = pq.read_schema(stage.path, filesystem=stage.fs)
    return [(field.name, str(field.type)) for field in schema]


def _sql_lineage(operator: LineageSource) -> OperatorLineage:
    """The tables an ``sql=`` input reads, parsed the way Airflow's SQL operators do: only hooks that
    describe their database to OpenLineage (Postgres, MySQL, Snowflake, ...) give table datasets;
    others still get the query as the ``sql`` job facet."""
    from airflow.providers.common.compat.openlineage.facet import SQLJobFacet
    from airflow.providers.openlineage.extractors import OperatorLineage
    from airflow.sdk import BaseHook

    sql, conn_id = operator.sql, operator.conn_id
    if sql is None or conn_id is None:  # the operator refuses this combination at parse time
        raise ValueError("an sql= input needs conn_id=")
    job_facets = {"sql": SQLJobFacet(query=sql)}
    connection = BaseHook.get_connection(conn_id)
    hook = connection.get_hook()
    get_info = getattr(hook, "get_openlineage_database_info", None)
    database_info = get_info(connection) if callable(get_info) else None
    if database_info is None:
        return OperatorLineage(job_facets=job_facets)
    from airflow.providers.openlineage.sqlparser import SQLParser

    parser = SQLParser(
        dialect=hook.get_openlineage_database_dialect(connection), default_schema=hook.get_openlineage_default_schema()
    )
    parsed = parser.generate_openlineage_metadata_from_sql(
        sql=sql, hook=hook, database_info=database_info, sqlalchemy_engine=None, use_connection=False
    )
    return OperatorLineage(
        inputs=parsed.inputs, job_facets={**parsed.job_facets, **job_facets}, run_facets=parsed.run_facets
    )


def _model_record(operator: LineageSource, manifest: Manifest | None) -> dict[str, Any]:
    """The model: from the manifest when committed, else from the registry (no re-hash: lineage
    only; a version the registry does not know still leaves the task's other datasets to report)."""
    if manifest is not None:
        return manifest.model.without_signature().to_dict()
    try:
        mv = operator.hook.get_model(operator.model, operator.version, verify=False)
    except RegistryError:
        return {"name": operator.model, "version": operator.version}
    return {
        "name": mv.name,
        "version": mv.version,
        "flavor": mv.flavor,
        "sha256": mv.sha256,
        "uri": mv.uri,
        "signature": mv.signature,
    }


def _input_datasets(operator: LineageSource, manifest: Manifest | None) -> list[Any]:
    """One dataset per input location, with its schema and statistics once a manifest lists its files."""
    from airflow.providers.common.compat.openlineage.facet import InputDataset
    from openlineage.client.generated.input_statistics_input_dataset import InputStatisticsInputDatasetFacet

    if operator.input is None:
        return []
    hook = operator.hook
    raw = [operator.input] if isinstance(operator.input, str) else list(operator.input)
    if is_table_input(operator.input):
        return [table_dataset(operator, parse_table_input(str(operator.input)).identifier, False, None)]
    locations = [hook.resolve_location(loc) for loc in raw]
    input_files = list(manifest.input_files) if manifest else []
    datasets = []
    for loc in locations:
        namespace, name = dataset_name(loc)
        facets: dict[str, Any] = {}
        input_facets: dict[str, Any] = {}
        if manifest is not None and input_files:
            mine = [f for f in input_files if f == loc or f.startswith(loc.rstrip("/") + "/")]
            if mine:
                facets["schema"] = _schema_facet(_parquet_fields(mine[0], hook.storage_options))
                input_facets["inputStatistics"] = InputStatisticsInputDatasetFacet(fileCount=len(mine))
        if manifest is not None and len(locations) == 1:
            input_facets.setdefault("inputStatistics", InputStatisticsInputDatasetFacet())
            input_facets["inputStatistics"].rowCount = manifest.counts.input_rows
        datasets.append(InputDataset(namespace=namespace, name=name, facets=facets, inputFacets=input_facets))
    return datasets


def _output_dataset(location: str, manifest: Manifest | None, signature: dict[str, Any], storage: Any) -> Any:
    """The run directory, with statistics and the written schema once committed; before the job,
    the model's outputs (the passthrough columns are known once it ran)."""
    from airflow.providers.common.compat.openlineage.facet import OutputDataset
    from openlineage.client.generated.output_statistics_output_dataset import OutputStatisticsOutputDatasetFacet

    namespace, name = dataset_name(location)
    facets: dict[str, Any] = {}
    output_facets: dict[str, Any] = {}
    if manifest is not None:
        files = manifest.files
        if files:
            facets = {"schema": _schema_facet(_parquet_fields(join(location, files[0].name), storage))}
        output_facets = {
            "outputStatistics": OutputStatisticsOutputDatasetFacet(
                rowCount=manifest.counts.output_rows, size=sum(f.size for f in files), fileCount=len(files)
            )
        }
    elif signature.get("outputs"):
        facets = {"schema": _schema_facet(list(signature["outputs"].items()))}
    return OutputDataset(namespace=namespace, name=name, facets=facets, outputFacets=output_facets)


def operator_lineage(operator: LineageSource, task_instance: Any = None, committed: bool = True) -> OperatorLineage:
    """Inputs, output and facets of one task instance.

    Without ``task_instance`` (the task is starting), only what is known before the job runs: the
    inputs, the model, and the output when ``stage_location`` names it. With it, the run directory
    is resolved and, when ``committed`` (the task succeeded), its ``_SUCCESS`` manifest adds
    statistics and exact schemas. A failed task never reads the manifest: one still there belongs to
    an earlier run (``SaveMode.ERROR`` refused to touch it).
    """
    from airflow.providers.common.compat.openlineage.facet import InputDataset
    from airflow.providers.openlineage.extractors import OperatorLineage

    hook = operator.hook
    storage = hook.storage_options
    location = None
    if task_instance is not None:
        location = operator.resolve_run_directory({"ti": task_instance})
    elif operator.stage_location:
        location = hook.resolve_location(operator.stage_location)
    table = operator.table  # an Iceberg table output (lineage_tables.py)
    if table and committed and task_instance is not None:
        manifest = table_manifest(operator, task_instance)
    else:
        read = committed and task_instance is not None and not table
        manifest = read_valid_manifest(location, storage) if location and read else None
    model = _model_record(operator, manifest)
    signature = model.pop("signature", None) or {}

    lineage = _sql_lineage(operator) if operator.sql is not None else OperatorLineage()
    inputs = [*lineage.inputs, *_input_datasets(operator, manifest)]
    if "uri" in model:
        namespace, name = dataset_name(model["uri"])
        inputs.append(InputDataset(namespace=namespace, name=name))
    if table:  # the table, not the claim directory
        outputs = [table_dataset(operator, str(table), True, manifest)]
    else:
        outputs = [] if location is None else [_output_dataset(location, manifest, signature, storage)]
    run_facet = _run_facet_class()(
        model={k: model[k] for k in ("name", "version", "flavor", "sha256") if k in model},
        job=manifest.job.to_dict() if manifest else {},
        counts={**manifest.counts.to_dict(), **(manifest.reuse.summary() if manifest.reuse else {})}
        if manifest
        else {},
        timings=dict(manifest.timings) if manifest else {},
        usage=manifest.usage.to_dict() if manifest and manifest.usage else {},
    )
    return OperatorLineage(
        inputs=inputs,
        outputs=outputs,
        job_facets=lineage.job_facets,
        run_facets={**lineage.run_facets, RUN_FACET: run_facet},
    )


class OpenLineageMethods:
    """Mixed into the operator; Airflow's OpenLineage provider calls these when it is installed.
    ``self`` is typed as the :class:`LineageSource` the operator is, so this module needs no import
    of the operator class."""

    def get_openlineage_facets_on_start(self: LineageSource) -> Any:
        """Inputs, the model and (with a fixed ``stage_location``) the output, before the job runs."""
        return operator_lineage(self)

    def get_openlineage_facets_on_complete(self: LineageSource, task_instance: Any) -> Any:
        """Inputs, the model and the run directory, with schemas and statistics from ``_SUCCESS``."""
        return operator_lineage(self, task_instance)

    def get_openlineage_facets_on_failure(self: LineageSource, task_instance: Any) -> Any:
        """What the task meant to read and write; nothing from a manifest (none of this try's)."""
        return operator_lineage(self, task_instance, committed=False)
