"""S3 settings from Airflow connections: the ``batchinfer`` connection's own fields, or an ``aws``
connection it references through ``aws_conn_id``.

Kept apart from the hook so the precedence rules are in one small place. The Amazon provider's
``AwsBaseHook`` is used when it is installed (it knows role assumption, profiles and session
tokens); without it, an ``aws`` connection is read by its documented fields (login = access key id,
password = secret access key, extras ``endpoint_url`` / ``region_name`` / ``aws_session_token``),
so the provider never requires the Amazon provider.

Also here: the role a job's processes assume (``role_arn``, ``role_session_name``, ``external_id``),
whether the connection's keys are shipped at all (``credentials``: ``connection`` | ``worker``),
and when temporary keys expire (``EXPIRATION``: botocore's refreshable credentials of an
``aws_conn_id``, or the extra ``aws_session_expiration``), which ``check_credential_lifetime``
compares with the job's timeout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from airflow_provider_batchinfer.store.s3 import CREDENTIAL_MODES

#: key of the options dict that carries the expiry of temporary keys (a timezone-aware datetime);
#: ``ServiceConfig`` takes it out before the options reach a filesystem
EXPIRATION = "expiration"
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
_SESSION_NAME = re.compile(r"^[\w+=,.@-]{2,64}$")
_EXTERNAL_ID = re.compile(r"^[\w+=,.@:/-]{2,1224}$")


def storage_options_from_connection(conn: Any, get_connection: Callable[[str], Any]) -> dict[str, Any]:
    """Storage options (see ``airflow_provider_batchinfer.store.s3``) for a ``batchinfer`` connection.

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
    options.update(role_options(extra, conn.conn_id))
    if options["session_token"]:
        options[EXPIRATION] = parse_expiration(extra.get("aws_session_expiration"), conn.conn_id)
    aws_conn_id = extra.get("aws_conn_id")
    if aws_conn_id:
        from_aws = _from_aws_connection(aws_conn_id, get_connection)
        if options.get("access_key"):  # the keys come as one set: an expiry belongs to its own token
            from_aws = {k: v for k, v in from_aws.items() if k not in ("access_key", "secret_key", "session_token")}
            from_aws.pop(EXPIRATION, None)
        for key, value in from_aws.items():
            if options.get(key) in (None, ""):
                options[key] = value
    return {k: v for k, v in options.items() if v not in (None, "")}


def role_options(extra: dict[str, Any], conn_id: str) -> dict[str, Any]:
    """``role_arn`` / ``role_session_name`` / ``external_id`` / ``sts_endpoint_url`` /
    ``credentials`` from a connection's extras, validated here so a typo fails the task before any
    work with the field's name, not an STS error from every Ray worker."""
    options: dict[str, Any] = {}
    role_arn = str(extra.get("role_arn") or "").strip()
    if role_arn:
        if not _ROLE_ARN.match(role_arn):
            raise ValueError(
                f"connection {conn_id!r}: role_arn {role_arn!r} is not an IAM role ARN such as "
                "arn:aws:iam::123456789012:role/batch-inference"
            )
        options["role_arn"] = role_arn
    for key, pattern, rule in (
        ("role_session_name", _SESSION_NAME, "2 to 64 letters, digits or +=,.@-"),
        ("external_id", _EXTERNAL_ID, "2 to 1224 letters, digits or +=,.@:/-"),
    ):
        value = str(extra.get(key) or "").strip()
        if not value:
            continue
        if not role_arn:
            raise ValueError(
                f"connection {conn_id!r}: {key} is set but role_arn is empty; set role_arn or remove {key}"
            )
        if not pattern.match(value):
            raise ValueError(f"connection {conn_id!r}: {key} {value!r} must be {rule}")
        options[key] = value
    mode = extra.get("credentials") or None
    if mode not in (None, *CREDENTIAL_MODES):
        raise ValueError(
            f"connection {conn_id!r}: credentials {mode!r} is not one of {CREDENTIAL_MODES}: 'connection' ships "
            "the connection's keys to the job, 'worker' ships none (the workers' own chain: instance profile, IRSA)"
        )
    if mode:
        options["credentials"] = mode
    if extra.get("sts_endpoint_url"):
        options["sts_endpoint_url"] = str(extra["sts_endpoint_url"])
    return options


def parse_expiration(value: Any, conn_id: str) -> datetime | None:
    """The extra ``aws_session_expiration``: when the session token expires, ISO 8601 with a
    timezone (``2026-11-23T14:30:00Z``, as ``aws sts assume-role`` prints it). None: unknown."""
    if value in (None, ""):
        return None
    try:
        when = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise ValueError(
            f"connection {conn_id!r}: aws_session_expiration {value!r} is not an ISO 8601 time with a timezone "
            "such as 2026-11-23T14:30:00Z (the Expiration that aws sts assume-role returns)"
        )
    return when


def expiry_of(credentials: Any) -> datetime | None:
    """When botocore credentials expire: refreshable ones (an assumed role, SSO, a container role)
    know it; static keys have none (None)."""
    when = getattr(credentials, "_expiry_time", None)
    return when if isinstance(when, datetime) else None


def _from_aws_connection(aws_conn_id: str, get_connection: Callable[[str], Any]) -> dict[str, Any]:
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError:
        aws = get_connection(aws_conn_id)
        extra = aws.extra_dejson or {}
        token = extra.get("aws_session_token")
        return {
            "access_key": aws.login or extra.get("aws_access_key_id"),
            "secret_key": aws.password or extra.get("aws_secret_access_key"),
            "session_token": token,
            "endpoint_url": extra.get("endpoint_url"),
            "region": extra.get("region_name"),
            EXPIRATION: parse_expiration(extra.get("aws_session_expiration"), aws_conn_id) if token else None,
        }
    hook = AwsBaseHook(aws_conn_id=aws_conn_id, client_type="s3")
    live = hook.get_session().get_credentials()  # refreshable ones know their expiry
    creds = live.get_frozen_credentials()
    config = hook.conn_config
    return {
        "access_key": creds.access_key,
        "secret_key": creds.secret_key,
        "session_token": creds.token,
        "endpoint_url": config.endpoint_url,
        "region": hook.region_name,
        EXPIRATION: expiry_of(live) if creds.token else None,
    }


#: kept between the credentials' expiry and the job's deadline: the finalize step, clock skew
LIFETIME_MARGIN_S = 300.0
_FIXES = (
    "set the connection extra role_arn (each Ray process then assumes that role from its own chain and "
    "refreshes it), or credentials: worker (no keys are shipped; the workers' instance profile / IRSA / "
    "environment refresh themselves), or give the connection permanent keys"
)


def credential_lifetime_problem(
    options: dict[str, Any], expiry: datetime | None, job_timeout: float | None, now: datetime, conn_id: str
) -> str | None:
    """Why the credentials a job would ship cannot last until its deadline (None: they can).

    Only shipped temporary keys (a session token) can run out mid-job: permanent keys do not
    expire, and without shipped keys each process refreshes its own. ``role_arn`` does not help
    when its base keys are the shipped temporary ones: refreshing the role needs them."""
    from airflow_provider_batchinfer.store.s3 import shipped_credentials

    if not shipped_credentials(options).get("session_token"):
        return None
    role_note = (
        " (role_arn is set, but the role is refreshed with these same temporary keys)"
        if options.get("role_arn")
        else ""
    )
    start = f"connection {conn_id!r}: the job was not started: its S3 credentials are temporary (a session token){role_note}"
    if job_timeout is None:
        when = f"expire at {expiry.isoformat()}" if expiry else "have no known expiry"
        return (
            f"{start} and {when}, and the task has no job_timeout, so the job may outlast them. To fix: {_FIXES}; "
            "or set job_timeout on the operator to less than the credentials' remaining lifetime"
        )
    deadline_s = job_timeout + LIFETIME_MARGIN_S
    if expiry is None:
        return (
            f"{start} with no known expiry, so a job of up to job_timeout={job_timeout:g}s cannot be shown to finish "
            f"before they expire. To fix: {_FIXES}; or, when the token outlives the job, set the extra "
            "aws_session_expiration to its expiry (ISO 8601, e.g. 2026-11-23T14:30:00Z)"
        )
    left = (expiry - now).total_seconds()
    if left >= deadline_s:
        return None
    fit = f"a job_timeout under {left - LIFETIME_MARGIN_S:.0f}s" if left > LIFETIME_MARGIN_S else "fresh credentials"
    return (
        f"{start} that expire at {expiry.isoformat()}, {max(left, 0):.0f}s from now, before the job's deadline "
        f"(job_timeout={job_timeout:g}s + {LIFETIME_MARGIN_S:g}s margin). To fix: {_FIXES}; or {fit}"
    )
