"""Issue 16.3: the operator's output is an Airflow Asset, and each commit is an Asset event whose
extra is the manifest's summary. Unit tests for the naming and the consumer's helpers; one
``dag.test()`` of the producer DAG (``tests/dags/assets/``) checked many ways: the event in the
metadata DB, its extra against the committed manifest, the XCom's usage section. The publish DAG
scheduled on the asset runs through the real scheduler in ``tests/services/test_airflow_services.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

import pytest
from airflow.sdk import Asset

from airflow_provider_batchinfer.contract.specs import OutputSpec
from airflow_provider_batchinfer.operators.assets import (
    attach_output_asset,
    event_extra,
    stage_asset,
    triggering_runs,
)
from airflow_provider_batchinfer.store.locations import sanitize_run_key
from tests.conftest import run_dag, xcom_value
from tests.models import committed_manifest, write_tickets


def test_the_default_asset_is_named_after_the_output_location():
    assert stage_asset("s3://lake/scores/churn/").uri == "s3://lake/scores/churn"
    assert stage_asset("/data/scores/").uri == "file:///data/scores"
    assert stage_asset("scores/churn", "bi_prod").uri == "x-batchinfer://bi_prod/scores/churn"
    assert stage_asset("scores/churn").name == "x-batchinfer://batchinfer_default/scores/churn"
    with pytest.raises(ValueError, match=r"is templated, so it is only known when the task runs.*output_asset=Asset"):
        stage_asset("{{ params.out }}")
    with pytest.raises(ValueError, match="needs an output location"):
        stage_asset(" ")


def _operator(output_spec: OutputSpec, **kwargs):
    from airflow_provider_batchinfer import BatchInferenceOperator

    return BatchInferenceOperator(
        task_id="infer", model="m", version="v1", input="in", output_spec=output_spec, **kwargs
    )


def test_the_operator_declares_its_output_asset_as_an_outlet():
    op = _operator(OutputSpec(base_stage_location="scores/churn"), model_service_conn_id="bi_prod")
    assert op.output_asset == stage_asset("scores/churn", "bi_prod") and op.outlets == [op.output_asset]
    mine = Asset(name="churn_scores", uri="s3://lake/published/churn")
    other = Asset(name="other")
    op = _operator(OutputSpec(stage_location="{{ params.out }}"), output_asset=mine, outlets=[other])
    assert op.output_asset == mine and op.outlets == [other, mine]
    assert _operator(OutputSpec(stage_location="{{ params.out }}")).output_asset is None  # no default name
    assert _operator(OutputSpec(stage_location="/x"), output_asset="scores").output_asset == Asset(name="scores")
    off = _operator(OutputSpec(stage_location="/x"), output_asset=False)
    assert off.output_asset is None and off.outlets == []
    with pytest.raises(TypeError, match="output_asset must be an Asset"):
        attach_output_asset(off, OutputSpec(stage_location="/x"), 3, "c")  # type: ignore[arg-type]


@dataclass
class _Event:
    extra: dict
    timestamp: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


def test_a_consumer_finds_the_run_directories_in_its_triggering_events():
    asset = stage_asset("scores/churn")
    early = _Event({"run_dir": "/s/run1", "rows": 5}, datetime(2026, 11, 1, tzinfo=timezone.utc))
    late = _Event({"run_dir": "/s/run2", "rows": 7}, datetime(2026, 11, 2, tzinfo=timezone.utc))
    foreign = _Event({"note": "not a batch inference commit"})
    context = {"triggering_asset_events": {asset: [late, foreign, early]}}
    assert [r["run_dir"] for r in triggering_runs(context)] == ["/s/run1", "/s/run2"]  # oldest first
    assert triggering_runs(context, asset)[-1]["rows"] == 7
    with pytest.raises(
        LookupError, match=r"no batch inference run among the triggering asset events \(\[.x-batchinfer"
    ):
        triggering_runs({"triggering_asset_events": {asset: [foreign]}})
    with pytest.raises(LookupError, match=r"events \(\[\]\)"):
        triggering_runs({})  # a manual run: no triggering events at all
    extra = event_extra(
        {"output_location": "/s/run1", "rows": 5, "sha256": "ab", "files": ["p"], "usage": {"cost": 0.25}}
    )
    assert extra == {"run_dir": "/s/run1", "rows": 5, "sha256": "ab", "cost": 0.25}


@pytest.mark.usefixtures("airflow_db")
def test_a_commit_emits_an_asset_event_with_the_manifest_summary(batchinfer_home, text_length_model, tmp_path):
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    inputs = write_tickets(tmp_path / "in", rows=300, files=3)
    state, tasks, run_id = run_dag("bi_test_asset_producer", input=str(inputs))
    assert state == "success", tasks
    run_dir = batchinfer_home / "stage" / "svc" / "assets" / sanitize_run_key(run_id)
    manifest = committed_manifest(str(run_dir))
    asset = stage_asset("svc/assets")
    with create_session() as session:
        events = session.scalars(
            select(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id).where(AssetModel.uri == asset.uri)
        ).all()
        found = [(e.extra, e.source_dag_id, e.source_task_id, e.source_run_id) for e in events]
    mine = [f for f in found if f[3] == run_id]
    assert len(mine) == 1, found  # exactly one event for the one commit
    extra, dag_id, task_id, _ = mine[0]
    assert (dag_id, task_id) == ("bi_test_asset_producer", "infer")
    assert extra == {
        "run_dir": str(run_dir),
        "manifest_location": str(run_dir / "_SUCCESS"),
        "rows": manifest["counts"]["output_rows"],
        "input_rows": 300,
        "error_rows": 0,
        "model": "text_length",
        "model_version": "v1",
        "sha256": manifest["model"]["sha256"],
        "job_id": manifest["job"]["id"],
        "attempt": manifest["job"]["attempt"],
    }  # no prices on the embedded default: no cost
    assert extra["rows"] == 300
    # the same run's XCom carries the usage section; without prices it has no cost
    usage = xcom_value("bi_test_asset_producer", run_id, "infer")["usage"]
    assert usage == manifest["usage"] and usage["cpu_seconds"] > 0 and usage["cost"] is None


def test_the_example_publish_dag_is_scheduled_on_the_example_inference_dags_asset():
    """Parse only: the pair in example_dags/ agrees on the asset without sharing a run id."""
    from airflow.dag_processing.dagbag import DagBag

    from tests.conftest import REPO

    bag = DagBag(dag_folder=str(REPO / "example_dags" / "batchinfer_scores_asset.py"))
    assert not bag.import_errors, bag.import_errors
    score = bag.dags["batchinfer_risk_scores"].get_task("score_customers")
    publish = bag.dags["batchinfer_publish_risk_scores"]
    assert score.outlets == [score.output_asset] == [stage_asset("scores/risk")]
    assert list(publish.timetable.asset_condition.objects) == [score.output_asset]
