"""A job's own S3 session, derived through STS on the Airflow worker, so that the connection's
long-lived keys never leave it.

A job on a cluster runs where the Airflow worker has no say over who reads what the job is given:
everything submitted through the Ray Jobs API (runtime_env, entrypoint, metadata) is listed back
to every client of the API, and a package the job carries is unpacked on every node. So the job is
never given the connection's keys. It is given a session derived from them for the job's duration:
``GetSessionToken`` (or ``AssumeRole`` when the connection names a role) with ``DurationSeconds``
bounded by the job's timeout; the session is useless once the job's time is up, and the long-lived
secret stays on the Airflow worker. Where the store has no STS, the job is refused with what to do
instead (docs/credentials.md); the key is never shipped as a fallback.

Shared layer: imports neither Airflow nor Ray (boto3 only, when a session is derived).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_provider_batchinfer.store.redact import scrub
from airflow_provider_batchinfer.store.s3 import DEFAULT_ROLE_SESSION_NAME, S3StageError, sts_client, sts_endpoint

#: kept between the job's deadline and the session's end: the finalize step, clock skew
SESSION_MARGIN_S = 300
#: STS's shortest session
MIN_SESSION_S = 900
#: without a job timeout: STS's own defaults (GetSessionToken 12 h; AssumeRole 1 h, a role's default maximum)
DEFAULT_SESSION_S = 43200
DEFAULT_ROLE_SESSION_S = 3600
#: STS's longest sessions: GetSessionToken 36 h; AssumeRole 12 h (and only when the role allows it)
MAX_SESSION_S = 129600
MAX_ROLE_SESSION_S = 43200
_TRANSIENT = ("Throttling", "ServiceUnavailable", "InternalFailure", "RequestTimeout")
_FIXES = (
    "The connection's keys are never given to a job on a cluster; a session derived from them through STS for the "
    "job's duration is (docs/credentials.md). To fix: point the connection extra sts_endpoint_url at an STS that "
    "accepts these keys (AWS: https://sts.amazonaws.com or your region's; MinIO serves STS on its own endpoint), "
    "or set the extra credentials: worker and give the Ray nodes their own identity (an instance profile, IRSA, "
    "or AWS_* variables in the nodes' environment)"
)


class JobSessionError(S3StageError):
    """No session could be derived; the message says why and what to configure instead."""


@dataclass(frozen=True)
class JobSession:
    """Temporary keys for one job. ``role_arn``: the role they belong to (None: the connection's own
    identity). ``repr`` holds no key."""

    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    session_token: str = field(repr=False)
    expiration: datetime
    role_arn: str | None = None

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that hand the session to a process."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_SESSION_TOKEN": self.session_token,
        }


def session_seconds(job_timeout: float | None, role: bool) -> int:
    """How long the job's session lasts: its timeout plus a margin (at least STS's 15 minutes), else
    STS's default. Raises JobSessionError when STS cannot give that long a session."""
    if job_timeout is None:
        return DEFAULT_ROLE_SESSION_S if role else DEFAULT_SESSION_S
    wanted = max(MIN_SESSION_S, int(job_timeout) + SESSION_MARGIN_S)
    longest = MAX_ROLE_SESSION_S if role else MAX_SESSION_S
    if wanted > longest:
        kind = "an assumed role's session" if role else "a session token"
        raise JobSessionError(
            f"the job was not started: job_timeout={job_timeout:g}s (+{SESSION_MARGIN_S}s margin) is longer than "
            f"STS gives {kind} ({longest}s). Lower job_timeout, or set the connection extra credentials: worker so "
            "that the Ray nodes' own identity (which refreshes itself) is used"
        )
    return wanted


def derive_session(options: dict[str, Any], job_timeout: float | None) -> JobSession:
    """A session for one job from the connection's keys in ``options``: ``AssumeRole`` when
    ``role_arn`` is set, else ``GetSessionToken``, lasting :func:`session_seconds`."""
    role_arn = options.get("role_arn")
    seconds = session_seconds(job_timeout, bool(role_arn))
    where = sts_endpoint(options) or "AWS STS"
    try:
        import boto3  # noqa: F401
    except ImportError as exc:
        raise JobSessionError(f"the job was not started: deriving its S3 session needs boto3. {_FIXES}") from exc
    client = sts_client(options)
    try:
        if role_arn:
            request: dict[str, Any] = {
                "RoleArn": role_arn,
                "RoleSessionName": options.get("role_session_name") or DEFAULT_ROLE_SESSION_NAME,
                "DurationSeconds": seconds,
            }
            if options.get("external_id"):
                request["ExternalId"] = options["external_id"]
            creds = client.assume_role(**request)["Credentials"]
        else:
            creds = client.get_session_token(DurationSeconds=seconds)["Credentials"]
    except Exception as exc:  # botocore's ClientError / EndpointConnectionError, named in the message
        known = [str(options.get(k) or "") for k in ("secret_key", "session_token")]
        what = f"assume role {role_arn!r}" if role_arn else "get a session token"
        error = JobSessionError(
            f"the job was not started: no job session could be derived through STS at {where} "
            f"(to {what} for {seconds}s): {scrub(f'{type(exc).__name__}: {exc}', known)}. {_FIXES}"
        )
        code = str((getattr(exc, "response", None) or {}).get("Error", {}).get("Code", ""))  # None: no reply
        error.permanent = not any(t in code for t in _TRANSIENT)
        raise error from exc
    return JobSession(
        access_key=str(creds["AccessKeyId"]),
        secret_key=str(creds["SecretAccessKey"]),
        session_token=str(creds["SessionToken"]),
        expiration=creds["Expiration"],
        role_arn=role_arn,
    )
