"""OpenLineage metadata of the operator, without a job run: naming, the start facets of a SQL input,
and a provider that still imports when OpenLineage is absent. The events that Airflow's
OpenLineage listener really emits after a run are asserted in tests/services/test_airflow_services.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from airflow_provider_batchinfer.operators.lineage import RUN_FACET
from airflow_provider_batchinfer.operators.lineage_tables import dataset_name
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        ("/data/stage/run1", ("file", "/data/stage/run1")),
        ("/data/stage/run1/", ("file", "/data/stage/run1")),
        ("file:///data/in/part-0.parquet", ("file", "/data/in/part-0.parquet")),
        ("s3://lake/prepared/tickets/", ("s3://lake", "prepared/tickets")),
        ("s3a://lake/scores/run1", ("s3://lake", "scores/run1")),
        ("s3://lake", ("s3://lake", "/")),
    ],
)
def test_dataset_names_follow_the_openlineage_naming_spec(location, expected):
    assert dataset_name(location) == expected


def test_start_facets_of_a_sql_input(text_length_model, tmp_path, monkeypatch):
    from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec

    monkeypatch.setenv(
        "AIRFLOW_CONN_BI_LINEAGE_SQLITE", json.dumps({"conn_type": "sqlite", "host": str(tmp_path / "t.db")})
    )
    query = "SELECT id AS ticket_id, body AS text FROM tickets"
    op = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        sql=query,
        conn_id="bi_lineage_sqlite",
        output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
    )
    lineage = op.get_openlineage_facets_on_start()
    # SQLite's hook does not describe its database to OpenLineage: the query is the job facet, and
    # the only dataset input is the model version
    assert lineage.job_facets["sql"].query == query
    assert [(d.namespace, d.name) for d in lineage.inputs] == [("file", text_length_model.uri)]
    (out,) = lineage.outputs
    assert (out.namespace, out.name) == ("file", str(tmp_path / "out"))
    assert [(f.name, f.type) for f in out.facets["schema"].fields] == [("length", "int64")]
    assert out.outputFacets == {}  # nothing committed yet: no statistics
    facet = lineage.run_facets[RUN_FACET]
    assert facet.model == {
        "name": "text_length",
        "version": "v1",
        "flavor": "python",
        "sha256": text_length_model.sha256,
    }
    assert facet.counts == {}


def test_the_provider_works_without_openlineage(tmp_path):
    """With the OpenLineage client unimportable (what the provider's lineage code needs), the
    provider and a DAG file using it still load."""
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "openlineage" or name.startswith("openlineage."):
                    raise ModuleNotFoundError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import runpy
        runpy.run_path({str(REPO / "tests" / "dags" / "batchinfer_services_dags.py")!r})
        from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec
        op = BatchInferenceOperator(task_id="t", model="m", version="v", input="/x", output_spec=OutputSpec(stage_location="/y"))
        assert not [m for m in sys.modules if m.startswith("openlineage")]
        try:
            op.get_openlineage_facets_on_start()
        except ImportError as exc:
            print("IMPORT-ERROR", exc)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    # only asking for lineage needs the packages (the OpenLineage provider never asks without them)
    assert "IMPORT-ERROR blocked:" in result.stdout


def test_an_unknown_model_version_still_names_the_task_datasets(text_length_model, tickets, tmp_path):
    """The task fails on the version; its lineage still says what it was meant to read and write."""
    from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec

    op = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v9",
        input=str(tickets[0]),
        output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
    )
    lineage = op.get_openlineage_facets_on_start()
    assert [(d.namespace, d.name) for d in lineage.inputs] == [("file", str(tickets[0]))]
    assert [(d.namespace, d.name, d.facets) for d in lineage.outputs] == [("file", str(tmp_path / "out"), {})]
    assert lineage.run_facets[RUN_FACET].model == {"name": "text_length", "version": "v9"}


# a catalog URI with a password, a bare token and secret query parameters; each catalog listens nowhere
_SECRETS = ("lineage-user-7c1d", "pw-7c1d-secret", "tok-7c1d-secret", "qtok-7c1d-secret")


def _catalogs(port: int) -> dict[str, tuple[dict[str, str], str]]:
    """{kind: (catalog properties, the namespace lineage may name the catalog by)}."""
    return {
        "sql": (
            {"type": "sql", "uri": f"postgresql://lineage-user-7c1d:pw-7c1d-secret@127.0.0.1:{port}/lake"},
            f"postgresql://127.0.0.1:{port}/lake",
        ),
        "rest": (
            {"type": "rest", "uri": f"http://tok-7c1d-secret@127.0.0.1:{port}/catalog?token=qtok-7c1d-secret&x=1"},
            f"http://127.0.0.1:{port}/catalog",
        ),
    }


@pytest.mark.parametrize("kind", ["sql", "rest"])
def test_a_table_named_by_its_catalog_carries_no_credential_of_the_catalog_uri(
    kind, text_length_model, tickets, tmp_path, monkeypatch
):
    """Before the table exists (the START event of a new output table), and whenever the catalog
    cannot be reached, a table has no location and lineage names it by its catalog: by the URI's
    scheme, host, port and path only, in the dataset's namespace and in its symlink, for an output
    table and for an input table, on START and on FAIL."""
    from openlineage.client.serde import Serde

    from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, OutputSpec
    from tests.conftest import _free_port
    from tests.task_context import TaskInstanceStandIn

    props, namespace = _catalogs(_free_port())[kind]
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps({"conn_type": "batchinfer", "extra": {"iceberg_catalog": props}})
    )
    writes = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=str(tickets[0]),
        input_spec=InputSpec(columns=["ticket_id", "text"]),
        output_spec=OutputSpec(table="lake.scores"),
    )
    reads = BatchInferenceOperator(
        task_id="infer_table",
        model="text_length",
        version="v1",
        input="iceberg://lake.tickets",
        input_spec=InputSpec(columns=["ticket_id", "text"]),
        output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
    )
    events = {
        "start": writes.get_openlineage_facets_on_start(),
        "fail": writes.get_openlineage_facets_on_failure(TaskInstanceStandIn()),
        "input": reads.get_openlineage_facets_on_start(),
    }
    (table_out,) = events["start"].outputs
    assert (table_out.namespace, table_out.name) == (namespace, "lake.scores")
    assert [(i.namespace, i.name) for i in table_out.facets["symlinks"].identifiers] == [(namespace, "lake.scores")]
    assert [(d.namespace, d.name) for d in events["fail"].outputs] == [(namespace, "lake.scores")]
    assert (events["input"].inputs[0].namespace, events["input"].inputs[0].name) == (namespace, "lake.tickets")
    for what, lineage in events.items():
        text = " ".join(Serde.to_json(d) for d in [*lineage.inputs, *lineage.outputs])
        for secret in _SECRETS:
            assert secret not in text, f"{secret} is in the {what} lineage"
        assert "***" not in text and "@" not in text
