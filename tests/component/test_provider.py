"""The provider as Airflow sees it: registered, listed, with its connection type and UI fields."""

from __future__ import annotations

import os
import subprocess
import sys


def test_airflow_providers_list_shows_the_provider(airflow_db):
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list", "-o", "json"],
        capture_output=True,
        text=True,
        env=os.environ,
        check=True,
    ).stdout
    assert "airflow-provider-batchinfer" in out


def test_connection_type_and_form_fields_are_registered(airflow_db):
    from airflow.providers_manager import ProvidersManager

    pm = ProvidersManager()
    hook = pm.hooks["batchinfer"]
    assert hook.hook_class_name == "airflow_provider_batchinfer.hooks.model_service.ModelServiceHook"
    assert hook.connection_id_attribute_name == "model_service_conn_id"
    widgets = pm.connection_form_widgets
    for field in ("stage_root", "registry_root", "launcher", "endpoint_url", "region_name", "aws_conn_id"):
        assert f"extra__batchinfer__{field}" in widgets
    behaviour = pm.field_behaviours["batchinfer"]
    assert "password" not in behaviour["hidden_fields"]  # the S3 secret access key
    assert behaviour["relabeling"]["login"] == "AWS access key id (s3:// locations)"
    assert behaviour["relabeling"]["host"] == "Ray address"


def test_hook_uses_embedded_default_without_a_connection_and_tests_it(airflow_db, batchinfer_home):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    hook = ModelServiceHook()
    assert hook.config.stage_root == str(batchinfer_home / "stage")
    assert hook.config.registry_root == str(batchinfer_home / "registry")
    ok, message = hook.test_connection()
    assert ok, message


def test_hook_reads_a_batchinfer_connection(airflow_db, tmp_path, monkeypatch):
    import json

    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    monkeypatch.setenv(
        "AIRFLOW_CONN_MY_BATCHINFER",
        json.dumps(
            {
                "conn_type": "batchinfer",
                "host": "127.0.0.1:6379",
                "extra": {"stage_root": str(tmp_path / "s"), "registry_root": str(tmp_path / "r")},
            }
        ),
    )
    cfg = ModelServiceHook("my_batchinfer").config
    assert (cfg.stage_root, cfg.registry_root, cfg.ray_address) == (
        str(tmp_path / "s"),
        str(tmp_path / "r"),
        "127.0.0.1:6379",
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_BAD_BATCHINFER", json.dumps({"conn_type": "batchinfer", "extra": {"launcher": "k8s"}})
    )
    import pytest

    with pytest.raises(ValueError, match="launcher 'k8s' is not available"):
        ModelServiceHook("bad_batchinfer").config
