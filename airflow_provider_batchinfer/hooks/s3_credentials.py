"""S3 settings from Airflow connections: the ``batchinfer`` connection's own fields, or an ``aws``
connection it references through ``aws_conn_id``.

Kept apart from the hook so the precedence rules are in one small place. The Amazon provider's
``AwsBaseHook`` is used when it is installed (it knows role assumption, profiles and session
tokens); without it, an ``aws`` connection is read by its documented fields (login = access key id,
password = secret access key, extras ``endpoint_url`` / ``region_name`` / ``aws_session_token``),
so the provider never requires the Amazon provider.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def storage_options_from_connection(conn: Any, get_connection: Callable[[str], Any]) -> dict[str, Any]:
    """Storage options (see ``airflow_provider_batchinfer.s3``) for a ``batchinfer`` connection.

    Precedence: the batchinfer connection's login/password and extras win; an ``aws_conn_id``
    fills in whatever they leave empty; whatever is still empty falls to the AWS default chain.
    """
    extra = conn.extra_dejson or {}
    options: dict[str, Any] = {
        "access_key": conn.login or None,
        "secret_key": conn.password or None,
        "session_token": extra.get("aws_session_token") or None,
        "endpoint_url": extra.get("endpoint_url") or None,
        "region": extra.get("region_name") or None,
    }
    for key in ("max_attempts", "connect_timeout", "request_timeout"):
        if extra.get(f"s3_{key}") not in (None, ""):
            options[key] = extra[f"s3_{key}"]
    aws_conn_id = extra.get("aws_conn_id")
    if aws_conn_id:
        for key, value in _from_aws_connection(aws_conn_id, get_connection).items():
            if options.get(key) in (None, ""):
                options[key] = value
    return {k: v for k, v in options.items() if v not in (None, "")}


def _from_aws_connection(aws_conn_id: str, get_connection: Callable[[str], Any]) -> dict[str, Any]:
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError:
        aws = get_connection(aws_conn_id)
        extra = aws.extra_dejson or {}
        return {
            "access_key": aws.login or extra.get("aws_access_key_id"),
            "secret_key": aws.password or extra.get("aws_secret_access_key"),
            "session_token": extra.get("aws_session_token"),
            "endpoint_url": extra.get("endpoint_url"),
            "region": extra.get("region_name"),
        }
    hook = AwsBaseHook(aws_conn_id=aws_conn_id, client_type="s3")
    creds = hook.get_credentials()
    config = hook.conn_config
    return {
        "access_key": creds.access_key,
        "secret_key": creds.secret_key,
        "session_token": creds.token,
        "endpoint_url": config.endpoint_url,
        "region": hook.region_name,
    }
