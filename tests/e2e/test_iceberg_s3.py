"""An Iceberg table with an ``s3://`` warehouse on the test S3 server (``moto_server`` on 127.0.0.1):
the stage root is in the bucket, so the embedded catalog puts its warehouse there, and the data files,
the table metadata and the run's manifest all go through the connection's S3 settings."""

from __future__ import annotations

import json

import pytest

from airflow_provider_batchinfer.contract.tables import SUMMARY_PREFIX
from tests.iceberg_support import SIGNATURE, data_files, operator, read_in_fresh_process
from tests.task_context import TaskInstanceStandIn

from airflow.sdk.exceptions import AirflowFailException  # isort: skip

KEY_ID, SECRET = "AKIDICEBERGTEST", "iceberg-s3cr3t-4f1a"
TABLE = "ml.s3_scores"


@pytest.fixture
def s3_world(s3_server, s3_bucket, monkeypatch, tmp_path):
    from airflow_provider_batchinfer.registry import ModelRegistry
    from airflow_provider_batchinfer.store.stage import Stage
    from tests.models import TextLength, write_tickets

    monkeypatch.setenv("BATCHINFER_HOME", str(tmp_path / "home"))  # the SQLite catalog lives here
    extra = {
        "endpoint_url": s3_server,
        "region_name": "us-east-1",
        "s3_max_attempts": 2,
        "stage_root": f"s3://{s3_bucket}/stage",
        "registry_root": f"s3://{s3_bucket}/registry",
    }
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCHINFER_DEFAULT",
        json.dumps({"conn_type": "batchinfer", "login": KEY_ID, "password": SECRET, "extra": extra}),
    )
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    options = {"endpoint_url": s3_server, "region": "us-east-1", "access_key": KEY_ID, "secret_key": SECRET}
    ModelRegistry(f"s3://{s3_bucket}/registry", options).log_model(
        "text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE
    )
    local = write_tickets(tmp_path / "input", rows=200, files=2)
    for path in sorted(local.iterdir()):
        Stage.open(f"s3://{s3_bucket}/input/{path.name}", options).write_bytes(path.read_bytes())
    return {"bucket": s3_bucket, "inputs": f"s3://{s3_bucket}/input", "options": options}


@pytest.mark.usefixtures("airflow_db")
def test_a_table_with_an_s3_warehouse_commits_one_snapshot(s3_world):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.store.iceberg.catalog import io_properties, open_catalog

    xcom = operator(TABLE, s3_world["inputs"]).execute({"ti": TaskInstanceStandIn(run_id="day1")})
    props = ModelServiceHook().catalog_properties()
    assert props["warehouse"] == f"s3://{s3_world['bucket']}/stage/_iceberg/warehouse"
    table = open_catalog(props, s3_world["options"]).load_table(TABLE)
    assert table.location().startswith(props["warehouse"]) and table.metadata_location.startswith("s3://")
    assert len(table.metadata.snapshots) == 1 and table.current_snapshot().snapshot_id == xcom["snapshot_id"]
    summary = table.current_snapshot().summary
    assert (summary["added-records"], summary[SUMMARY_PREFIX + "run-key"]) == ("200", "day1")
    assert summary[SUMMARY_PREFIX + "manifest"].startswith(f"s3://{s3_world['bucket']}/stage/_iceberg/")
    files = data_files(table)
    assert files and all(p.startswith(f"s3://{s3_world['bucket']}/") and f"/{xcom['attempt']}/" in p for p in files)

    # an independent reader in a fresh process, with the S3 settings as pyiceberg properties
    seen = read_in_fresh_process({**props, **io_properties(s3_world["options"])}, TABLE, "day1", xcom["snapshot_id"])
    assert seen["rows"] == 200 and seen["ids"] == list(range(200))
    # the sensor's check, read_committed through the connection, and no secret in what was written
    manifest = _manifest(xcom)
    assert ModelServiceHook().read_committed(manifest).num_rows == 200
    assert SECRET not in json.dumps(manifest) and SECRET not in table.metadata.model_dump_json()  # summaries too

    with pytest.raises(AirflowFailException, match=r"already holds 200 row\(s\) of run key day1"):
        operator(TABLE, s3_world["inputs"]).execute({"ti": TaskInstanceStandIn(run_id="day1", try_number=2)})
    assert len(open_catalog(props, s3_world["options"]).load_table(TABLE).metadata.snapshots) == 1


def _manifest(xcom: dict) -> dict:
    """The committed manifest of the run, as the sensor pushes it to XCom."""
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    manifest = read_valid_manifest(
        xcom["output_location"], ModelServiceHook().table_read_options(), verify_checksums=True
    )
    assert manifest is not None
    return manifest.to_dict()
