"""S3 and S3-compatible stores (MinIO, R2, ...) for stages, inputs and the model registry.

Shared by both sides, so it imports neither Airflow nor Ray. Two kinds of settings travel apart:

- *storage options* (``endpoint_url``, ``region``, ``max_attempts``, ``connect_timeout``) are not
  secret: they go into the job spec so the runtime opens the same store;
- *credentials* (``access_key``, ``secret_key``, ``session_token``) exist on the Airflow side only in
  memory and reach the runtime subprocess as ``AWS_*`` environment variables (a job on a cluster gets
  a session derived from them instead, ``job_session.py``), and the Ray workers through a setup hook
  (``runtime/attach.py``). They are never written into ``_job.json``, the manifest, XCom, a log or
  a Ray job's ``runtime_env``.

When no credentials are given, pyarrow uses the AWS default chain (environment variables, config
files, instance roles), so the runtime and its workers need nothing but their environment. A
filesystem built that way pickles without secrets, which matters: Ray ships it to every read and
write task.

Long jobs (see docs/credentials.md): shipped keys are frozen, so temporary ones (a session token)
expire mid-job. Two ways out, both public settings: ``role_arn`` (every process that opens S3
assumes the role itself through pyarrow's STS provider, which refreshes the session), and
``credentials="worker"`` (no keys are shipped: each process uses its own chain, e.g. an instance
profile or IRSA, which refresh themselves).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.store.locations import StageError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

S3_SCHEMES = ("s3", "s3a")
SECRET_KEYS = ("access_key", "secret_key", "session_token")
ROLE_KEYS = ("role_arn", "role_session_name", "external_id")
PUBLIC_KEYS = (
    "endpoint_url",
    "region",
    "max_attempts",
    "connect_timeout",
    "request_timeout",
    "sts_endpoint_url",
    "credentials",
    *ROLE_KEYS,
)
#: ``credentials`` option: ship the connection's keys to the job (default), or ship none
CREDENTIAL_MODES = ("connection", "worker")
DEFAULT_ROLE_SESSION_NAME = "batchinfer"
#: ``role_arn`` / ``role_session_name`` / ``external_id`` in a process's environment (not AWS_ROLE_ARN:
#: that one belongs to web identity / IRSA and would change which role IRSA assumes)
ROLE_ENV = ("BATCHINFER_S3_ROLE_ARN", "BATCHINFER_S3_ROLE_SESSION_NAME", "BATCHINFER_S3_EXTERNAL_ID")
#: the role whose session this process's ``AWS_*`` keys already are (a job's session derived on the
#: Airflow side, ``job_session.py``): that role is not assumed again
ASSUMED_ROLE_ENV = "BATCHINFER_S3_ASSUMED_ROLE"
# what the runtime's Ray workers need from the runtime's own environment; nothing else is forwarded
WORKER_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL_STS",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    *ROLE_ENV,
    ASSUMED_ROLE_ENV,
)
DEFAULT_MAX_ATTEMPTS = 5
# errors that retrying cannot fix: fail at once, without Airflow retries
_DENIED = re.compile(
    r"NO_SUCH_BUCKET|NoSuchBucket|ACCESS_DENIED|AccessDenied|INVALID_ACCESS_KEY_ID|InvalidAccessKeyId|"
    r"SIGNATURE_DOES_NOT_MATCH|SignatureDoesNotMatch|does not exist|Forbidden"
)
# the store cannot be reached at all: a wrong endpoint when a task starts, an outage mid-job
_UNREACHABLE = re.compile(r"Could not resolve host|Could not connect to server|Failed to connect")


class S3StageError(StageError):
    """Base for S3 failures. ``permanent``: no retry could help (no such bucket, access denied, an
    endpoint that cannot be reached when the task starts). ``unreachable``: the store did not answer
    at all; the runtime treats that as an outage rather than a misconfiguration, because the task
    reached the same store moments before the job started (see ``runtime.reporting.is_permanent``)."""

    permanent = False
    unreachable = False


def is_s3(location: str) -> bool:
    return location.split("://", 1)[0].lower() in S3_SCHEMES if "://" in location else False


def split_uri(location: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://bucket/key``."""
    rest = location.split("://", 1)[1] if "://" in location else location
    bucket, _, key = rest.partition("/")
    return bucket, key.rstrip("/")


def public_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The part of the storage options that may be written to a job spec: no credentials."""
    return {k: v for k, v in (options or {}).items() if k in PUBLIC_KEYS and v not in (None, "")}


def shipped_credentials(options: dict[str, Any] | None) -> dict[str, Any]:
    """The keys a job would carry to its driver and workers: the connection's, unless
    ``credentials="worker"`` says the workers use their own chain."""
    options = options or {}
    if options.get("credentials") == "worker":
        return {}
    return {k: options[k] for k in SECRET_KEYS if options.get(k)}


def credential_env(options: dict[str, Any] | None) -> dict[str, str]:
    """Environment variables handing credentials and endpoints to the runtime subprocess (and from
    there to its workers, see :func:`worker_env`)."""
    options = options or {}
    values = {**options, **dict.fromkeys(SECRET_KEYS), **shipped_credentials(options)}
    env = {}
    for key, var in (
        ("access_key", "AWS_ACCESS_KEY_ID"),
        ("secret_key", "AWS_SECRET_ACCESS_KEY"),
        ("session_token", "AWS_SESSION_TOKEN"),
        ("endpoint_url", "AWS_ENDPOINT_URL"),
        ("sts_endpoint_url", "AWS_ENDPOINT_URL_STS"),
        ("region", "AWS_DEFAULT_REGION"),
        *zip(ROLE_KEYS, ROLE_ENV, strict=True),  # the runtime reads its job file before it knows the job's options
    ):
        if values.get(key):
            env[var] = str(values[key])
    return env


def worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``AWS_*`` variables of this process that Ray workers need to reach the same store: built
    from the runtime's own environment at ``ray.init`` time, never written to disk."""
    source: Mapping[str, str] = os.environ if environ is None else environ
    return {k: source[k] for k in WORKER_ENV if source.get(k)}


def filesystem(options: dict[str, Any] | None = None) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem with retries (throttling, 5xx, resets: AWS standard strategy with
    backoff), the endpoint from the options or ``AWS_ENDPOINT_URL[_S3]``, and explicit credentials
    only when the options carry them (else the AWS default chain)."""
    import pyarrow.fs as pafs

    options = dict(options or {})
    unknown = set(options) - set(PUBLIC_KEYS) - set(SECRET_KEYS)
    if unknown:
        raise ValueError(f"unknown S3 storage option(s) {sorted(unknown)}; known: {PUBLIC_KEYS + SECRET_KEYS}")
    kwargs: dict[str, Any] = {
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(
            max_attempts=int(options.get("max_attempts") or DEFAULT_MAX_ATTEMPTS)
        ),
        "connect_timeout": float(options.get("connect_timeout") or 10),
        "request_timeout": float(options.get("request_timeout") or 60),
    }
    endpoint = (
        options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        if not host:
            scheme, host = "https", endpoint
        kwargs["endpoint_override"] = host.rstrip("/")
        kwargs["scheme"] = scheme
    region = options.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    role = role_settings(options)
    if options.get("access_key") or options.get("secret_key"):
        if not (options.get("access_key") and options.get("secret_key")):
            raise ValueError("S3 credentials need both an access key id and a secret access key")
        keys: dict[str, Any] = {k: options.get(k) for k in SECRET_KEYS}
        if role:  # pyarrow assumes a role only from the default chain
            keys = assume_role({**options, **role})
        kwargs.update(keys)
    elif role:
        # this process's own chain assumes the role; pyarrow refreshes the session before it expires.
        # Pickles without secrets: each Ray task that unpickles it assumes the role itself.
        kwargs.update(
            role_arn=role["role_arn"],
            session_name=role.get("role_session_name") or DEFAULT_ROLE_SESSION_NAME,
            external_id=role.get("external_id") or "",
        )
    return pafs.S3FileSystem(**kwargs)


def role_settings(options: dict[str, Any]) -> dict[str, str]:
    """The role to assume: the options', else ``BATCHINFER_S3_ROLE_*`` from the environment (how the
    runtime knows it before it has read its job file, and its workers after). Empty: no role, or
    the role whose session this process already holds (``BATCHINFER_S3_ASSUMED_ROLE``)."""
    role: dict[str, str] = {}
    if options.get("role_arn"):
        role = {k: str(options[k]) for k in ROLE_KEYS if options.get(k)}
    elif os.environ.get(ROLE_ENV[0]):
        role = {k: os.environ[var] for k, var in zip(ROLE_KEYS, ROLE_ENV, strict=True) if os.environ.get(var)}
    if role and os.environ.get(ASSUMED_ROLE_ENV) == role["role_arn"]:
        return {}
    return role


_ROLE_SESSIONS: dict[tuple[Any, ...], tuple[float, dict[str, str]]] = {}
_ROLE_LOCK = threading.Lock()
ROLE_SESSION_S = 3600
_ROLE_REUSE_MARGIN_S = 600


def sts_endpoint(options: dict[str, Any]) -> str | None:
    """Where AssumeRole goes, in the order the AWS SDKs (pyarrow's too) read it: the STS-specific
    setting, then the store's endpoint, else AWS's own STS."""
    return (
        options.get("sts_endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_STS")
        or options.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )


def sts_client(options: dict[str, Any]) -> Any:
    """A boto3 STS client signed with the options' own keys, at their STS endpoint: what both a
    role's session here and a job's derived session ask for."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "sts",
        endpoint_url=sts_endpoint(options),
        config=Config(connect_timeout=10, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"}),
        region_name=options.get("region") or os.environ.get("AWS_REGION") or "us-east-1",
        aws_access_key_id=options["access_key"],
        aws_secret_access_key=options["secret_key"],
        aws_session_token=options.get("session_token") or None,
    )


def assume_role(options: dict[str, Any]) -> dict[str, str]:
    """Temporary keys of ``role_arn``, assumed with the explicit keys in ``options`` (pyarrow can
    assume a role only from the default chain). Used on the Airflow side, whose S3 work is short
    (checks, the job file, the marker); a session is reused until 10 minutes before it expires.
    The runtime never gets here: its options carry no keys."""
    try:
        import boto3  # noqa: F401  (the message below names the missing package)
    except ImportError as exc:
        raise ValueError(
            "role_arn with access keys on the connection needs boto3 on the Airflow worker (pip install boto3); "
            "or leave the keys empty so the worker's own credential chain assumes the role"
        ) from exc
    cache_key = (*(options.get(k) for k in (*SECRET_KEYS, *ROLE_KEYS, "region")), sts_endpoint(options))
    with _ROLE_LOCK:
        cached = _ROLE_SESSIONS.get(cache_key)
        if cached and cached[0] - time.time() > _ROLE_REUSE_MARGIN_S:
            return dict(cached[1])
        client = sts_client(options)
        request: dict[str, Any] = {
            "RoleArn": options["role_arn"],
            "RoleSessionName": options.get("role_session_name") or DEFAULT_ROLE_SESSION_NAME,
            "DurationSeconds": ROLE_SESSION_S,
        }
        if options.get("external_id"):
            request["ExternalId"] = options["external_id"]
        try:
            creds = client.assume_role(**request)["Credentials"]
        except Exception as exc:  # botocore's ClientError / EndpointConnectionError, named in the message
            where = sts_endpoint(options) or "AWS STS"
            error = S3StageError(
                f"could not assume role {options['role_arn']!r} for S3 at {where}: {exc}. Check role_arn, the role's "
                "trust policy (and external_id), and sts_endpoint_url in the connection"
            )
            error.permanent = True
            raise error from exc
        keys = {
            "access_key": creds["AccessKeyId"],
            "secret_key": creds["SecretAccessKey"],
            "session_token": creds["SessionToken"],
        }
        _ROLE_SESSIONS[cache_key] = (creds["Expiration"].timestamp(), keys)
        return dict(keys)


def check_bucket(fs: pafs.FileSystem, location: str) -> None:
    """Fail fast, naming the bucket, when it does not exist: S3 reports a missing key and a missing
    bucket alike on a HEAD, so an empty-directory check alone would pass and the first write fail."""
    import pyarrow.fs as pafs

    bucket, _ = split_uri(location)
    with translate_errors(location, "check bucket"):
        kind = fs.get_file_info(bucket).type
    if kind == pafs.FileType.NotFound:
        error = S3StageError(
            f"S3 bucket {bucket!r} does not exist (location {location}); create it or fix the "
            "location / endpoint_url in the connection"
        )
        error.permanent = True
        raise error


@contextmanager
def translate_errors(location: str, operation: str) -> Iterator[None]:
    """Turn pyarrow's OSError from S3 into an S3StageError naming the bucket, key and what was being
    done. A missing key stays FileNotFoundError (callers test for it)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as exc:
        bucket, key = split_uri(location)
        error = S3StageError(f"S3 {operation} failed for bucket {bucket!r}, key {key!r} ({location}): {exc}")
        error.unreachable = bool(_UNREACHABLE.search(str(exc)))
        error.permanent = bool(_DENIED.search(str(exc))) or error.unreachable
        raise error from exc
