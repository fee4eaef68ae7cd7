"""The connection parsed once (``ServiceConfig.from_connection``) with one not-found policy, and the
connection form defined once for ``get_provider_info`` and the hook."""

from __future__ import annotations

import json

import pytest
from airflow.sdk import Connection

from airflow_provider_batchinfer.hooks.service_config import ConnectionNotFoundError, ServiceConfig


def _conn(
    host: str | None = None, login: str | None = None, password: str | None = None, **extra: object
) -> Connection:
    return Connection(
        conn_id="c", conn_type="batchinfer", host=host, login=login, password=password, extra=json.dumps(extra)
    )


def test_an_absent_default_connection_is_the_embedded_default(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHINFER_HOME", str(tmp_path))
    cfg = ServiceConfig.from_connection(None, "batchinfer_default")
    assert (cfg.stage_root, cfg.registry_root, cfg.launcher, cfg.ray_address) == (
        str(tmp_path / "stage"),
        str(tmp_path / "registry"),
        "local",
        None,
    )
    assert cfg.storage_options == {} and cfg.ray_headers == {}


def test_any_other_absent_connection_is_a_clear_error():
    with pytest.raises(
        ConnectionNotFoundError,
        match=r"connection 'my_typo' is not defined\. Create a connection of "
        r"type 'batchinfer'.*AIRFLOW_CONN_MY_TYPO",
    ):
        ServiceConfig.from_connection(None, "my_typo")


def test_one_parse_gives_config_storage_options_and_ray_headers(tmp_path):
    conn = _conn(
        host="ray-head:8265",
        login="AKID",
        password="SECRET",
        launcher="ray_jobs",
        ray_token="tok",
        headers={"X-Team": "ml"},
        endpoint_url="http://minio:9000",
        region_name="eu-west-1",
        stage_root="s3://lake/stage",
        allowed_roots="/data/a, s3://lake/images",
        python="/opt/py",
        runtime_env='{"pip": ["x"]}',
        llm_engine="transformers",
    )
    cfg = ServiceConfig.from_connection(conn, "c")
    assert cfg.launcher == "ray_jobs" and cfg.ray_address == "http://ray-head:8265"
    assert cfg.ray_headers == {"X-Team": "ml", "Authorization": "Bearer tok"}
    assert cfg.storage_options == {
        "access_key": "AKID",
        "secret_key": "SECRET",
        "endpoint_url": "http://minio:9000",
        "region": "eu-west-1",
    }
    assert cfg.s3 == {"endpoint_url": "http://minio:9000", "region": "eu-west-1"}
    assert cfg.allowed_roots == ("/data/a", "s3://lake/images") and cfg.runtime_env == {"pip": ["x"]}
    assert cfg.file_roots == ["s3://lake/stage", "/data/a", "s3://lake/images"]
    assert (cfg.python, cfg.llm_engine) == ("/opt/py", "transformers")
    # what may be logged holds no secret
    shown = json.dumps(cfg.to_dict()) + repr(cfg)
    assert "SECRET" not in shown and "tok" not in shown and "AKID" not in shown


def test_the_embedded_rays_idle_timeout_reaches_the_local_launcher():
    from airflow_provider_batchinfer.launchers.local import LocalLauncher

    cfg = ServiceConfig.from_connection(_conn(local_ray_idle_s="90"), "c")
    assert cfg.local_ray_idle_s == 90.0 and cfg.to_dict()["local_ray_idle_s"] == 90.0
    assert LocalLauncher.from_config(cfg).idle_s == 90.0
    assert ServiceConfig.from_connection(_conn(), "c").local_ray_idle_s is None


def test_aws_conn_id_is_resolved_through_the_given_lookup():
    aws = Connection(
        conn_id="aws", conn_type="aws", login="AK2", password="SK2", extra=json.dumps({"region_name": "r"})
    )
    cfg = ServiceConfig.from_connection(_conn(aws_conn_id="aws"), "c", get_connection={"aws": aws}.__getitem__)
    assert cfg.storage_options["access_key"] == "AK2" and cfg.storage_options["region"] == "r"


@pytest.mark.parametrize(
    ("conn", "message"),
    [
        (_conn(launcher="k8s"), "launcher 'k8s' is not available"),
        (_conn(launcher="ray_jobs"), "the ray_jobs launcher needs the Ray dashboard address"),
        (_conn(llm_engine="tgi"), "llm_engine 'tgi' is not available"),
        (_conn(allowed_roots="relative/dir"), "allowed_roots entry 'relative/dir' must be an absolute path"),
        (_conn(local_ray_idle_s="soon"), "local_ray_idle_s must be a number of seconds >= 0"),
        (_conn(local_ray_idle_s=-5), "local_ray_idle_s must be a number of seconds >= 0"),
    ],
)
def test_bad_connections_say_what_is_wrong(conn, message):
    with pytest.raises(ValueError, match=message):
        ServiceConfig.from_connection(conn, "c")


def test_the_form_is_defined_once_for_provider_info_and_the_hook():
    from airflow_provider_batchinfer.get_provider_info import get_provider_info
    from airflow_provider_batchinfer.hooks import connection_fields
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    (conn_type,) = get_provider_info()["connection-types"]
    published = conn_type["ui-field-behaviour"]
    hook = ModelServiceHook.get_ui_field_behaviour()
    assert hook == {
        "hidden_fields": published["hidden-fields"],
        "relabeling": published["relabeling"],
        "placeholders": published["placeholders"],
    }
    assert conn_type["conn-fields"] == connection_fields.CONN_FIELDS
    assert conn_type["connection-type"] == ModelServiceHook.conn_type
    # every extra the config reads is on the form, and the launcher choice is the registry's
    assert conn_type["conn-fields"]["launcher"]["schema"]["enum"] == ["local", "ray_jobs", None]
    for extra in (
        "stage_root",
        "registry_root",
        "launcher",
        "allowed_roots",
        "llm_engine",
        "endpoint_url",
        "region_name",
        "aws_conn_id",
        "runtime_env",
        "ray_token",
        "python",
        "credentials",
        "role_arn",
        "role_session_name",
        "external_id",
        "sts_endpoint_url",
        "aws_session_token",
        "aws_session_expiration",
        "local_ray_idle_s",
    ):
        assert extra in conn_type["conn-fields"], extra
    assert conn_type["conn-fields"]["ray_token"]["schema"]["format"] == "password"
    assert conn_type["conn-fields"]["aws_session_token"]["schema"]["format"] == "password"
    assert conn_type["conn-fields"]["credentials"]["schema"]["enum"] == ["connection", "worker", None]


def test_connection_fields_import_no_airflow():
    import subprocess
    import sys

    code = (
        "import sys, airflow_provider_batchinfer.hooks.connection_fields, "
        "airflow_provider_batchinfer.hooks.service_config; "
        "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
