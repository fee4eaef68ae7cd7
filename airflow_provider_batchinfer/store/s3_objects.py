"""Conditional requests on S3 objects: what the commit protocol needs and pyarrow cannot send.

pyarrow's S3 filesystem writes and deletes unconditionally; the commit needs ``If-None-Match: *``
(create only when absent), ``If-Match: <etag>`` (replace or delete only the very version that was
read) and the ETag of what it reads. These go through boto3, with a client built from the settings
of the pyarrow filesystem the stage already uses (the way pyarrow pickles it): the same endpoint,
region, keys or role, so both clients always reach the same store as the same principal. Shared by
both sides: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.store.s3 import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_ROLE_SESSION_NAME,
    S3StageError,
    translate_errors,
)

if TYPE_CHECKING:
    from airflow_provider_batchinfer.store.stage import Stage

__all__ = [
    "ConditionsRejected",
    "PreconditionFailed",
    "S3Object",
    "delete",
    "get",
    "head_etag",
    "ignored_conditions",
    "list_versions",
    "put",
    "store_name",
]

# a client holds temporary keys when it assumed a role: rebuild it well before they expire
_CLIENT_TTL_S = 1800
_CLIENTS: dict[tuple[Any, ...], tuple[float, Any]] = {}
_LOCK = threading.Lock()
# 412: the condition does not hold; 404 on If-Match: the key is gone; 409: a concurrent request on
# the same key won (S3 answers ConditionalRequestConflict): all mean "not the version you read"
_REFUSED = {"PreconditionFailed", "NoSuchKey", "404", "ConditionalRequestConflict", "409"}
# the headers a store that rejects them names in its 400 InvalidArgument (lower case)
_CONDITION_HEADERS = ("if-none-match", "if-match")
# what each store answered to the probe, by (endpoint, bucket): the conditions it ignores
_PROBED: dict[tuple[str, str], tuple[str, ...]] = {}
# an ETag no object has (the MD5 of nothing is d41d8...; no content hashes to all zeros in practice)
_NO_VERSION = '"00000000000000000000000000000000"'


class PreconditionFailed(Exception):
    """The store refused a conditional request: the object is not in the state it was asked for."""


class ConditionsRejected(S3StageError):
    """The store answered a conditional request with an error saying it does not support the
    condition (501 NotImplemented, or 400 InvalidArgument naming the header), not with a refusal:
    it cannot fence a commit, and no retry changes that. ``answer``: status and code, as sent."""

    permanent = True

    def __init__(self, message: str, answer: str) -> None:
        super().__init__(message)
        self.answer = answer


@dataclass(frozen=True)
class S3Object:
    """An object's bytes, its ETag and its user metadata (``x-amz-meta-*``, without the prefix)."""

    body: bytes
    etag: str
    metadata: Mapping[str, str] = field(default_factory=dict)


def _settings(fs: Any) -> dict[str, Any]:
    """The keyword arguments ``fs`` was built with (pyarrow's own pickling)."""
    reduced = fs.__reduce__()
    return dict(reduced[1][0])


def _new_client(cfg: dict[str, Any]) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # a declared dependency; only a broken environment lacks it
        error = S3StageError(f"committing to S3 needs boto3 for its conditional writes: {exc}")
        error.permanent = True
        raise error from exc
    endpoint = f"{cfg.get('scheme') or 'https'}://{cfg['endpoint_override']}" if cfg.get("endpoint_override") else None
    keys: dict[str, Any] = {}
    if cfg.get("access_key"):
        keys = {
            "aws_access_key_id": cfg["access_key"],
            "aws_secret_access_key": cfg["secret_key"],
            "aws_session_token": cfg.get("session_token") or None,
        }
    elif cfg.get("role_arn"):
        keys = _assumed(cfg, endpoint)
    timeouts = {k: v for k, v in (("connect_timeout", cfg.get("connect_timeout")),) if v and v > 0}
    read_timeout = cfg.get("request_timeout")
    config = Config(
        retries={"max_attempts": DEFAULT_MAX_ATTEMPTS, "mode": "standard"},
        s3={"addressing_style": "virtual" if cfg.get("force_virtual_addressing") or not endpoint else "path"},
        **timeouts,
        **({"read_timeout": read_timeout} if read_timeout and read_timeout > 0 else {}),
    )
    verify = cfg.get("tls_ca_file_path") or None
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name=cfg.get("region") or None, config=config, verify=verify, **keys
    )


def _assumed(cfg: dict[str, Any], endpoint: str | None) -> dict[str, Any]:
    """Temporary keys of the filesystem's role, assumed from this process's own credential chain
    (what pyarrow does for the same filesystem)."""
    import boto3

    from airflow_provider_batchinfer.store.s3 import sts_endpoint

    sts = boto3.client(
        "sts", endpoint_url=sts_endpoint({"endpoint_url": endpoint}), region_name=cfg.get("region") or "us-east-1"
    )
    request: dict[str, Any] = {
        "RoleArn": cfg["role_arn"],
        "RoleSessionName": cfg.get("session_name") or DEFAULT_ROLE_SESSION_NAME,
    }
    if cfg.get("external_id"):
        request["ExternalId"] = cfg["external_id"]
    with translate_errors(cfg["role_arn"], "assume role"):
        try:
            creds = sts.assume_role(**request)["Credentials"]
        except Exception as exc:  # botocore errors: one message, named
            raise OSError(str(exc)) from exc
    return {
        "aws_access_key_id": creds["AccessKeyId"],
        "aws_secret_access_key": creds["SecretAccessKey"],
        "aws_session_token": creds["SessionToken"],
    }


def _client(stage: Stage) -> Any:
    cfg = _settings(stage.fs)
    key = tuple(sorted((k, repr(v)) for k, v in cfg.items()))
    with _LOCK:
        cached = _CLIENTS.get(key)
        if cached is not None and time.monotonic() - cached[0] < _CLIENT_TTL_S:
            return cached[1]
        client = _new_client(cfg)
        _CLIENTS[key] = (time.monotonic(), client)
        return client


def _bucket_key(stage: Stage) -> tuple[str, str]:
    bucket, _, key = stage.path.partition("/")
    return bucket, key


def _rejected_conditions(response: Mapping[str, Any]) -> str | None:
    """``"<status> <code>"`` when an error answer to a conditional request says the store does not
    support the condition (rather than that the object is not in that state); else None."""
    error = response.get("Error") or {}
    code = str(error.get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    named = " ".join(str(error.get(k, "")) for k in ("Message", "ArgumentName")).lower()
    if code == "NotImplemented" or status == 501:
        return f"{status or 501} {code or 'NotImplemented'}"
    if code == "InvalidArgument" and any(header in named for header in _CONDITION_HEADERS):
        return f"{status or 400} {code}"
    return None


@contextmanager
def _requests(stage: Stage, operation: str, conditional: bool = False) -> Iterator[None]:
    """A refused condition becomes PreconditionFailed; a ``conditional`` request whose conditions
    the store does not support, ConditionsRejected; every other failure an S3StageError naming
    bucket, key and operation, ``permanent`` and ``unreachable`` as for pyarrow's errors."""
    from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, EndpointConnectionError

    with translate_errors(stage.location, operation):
        try:
            yield
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _REFUSED:
                raise PreconditionFailed(f"{operation} {stage.location}: {code}") from exc
            answer = _rejected_conditions(exc.response) if conditional else None
            if answer is not None:
                bucket, key = _bucket_key(stage)
                raise ConditionsRejected(
                    f"S3 {operation} failed for bucket {bucket!r}, key {key!r} ({stage.location}): the store does "
                    f"not support its conditional headers ({exc})",
                    answer,
                ) from exc
            raise OSError(str(exc)) from exc
        except (EndpointConnectionError, ConnectionError) as exc:
            raise OSError(f"Could not connect to server: {exc}") from exc
        except BotoCoreError as exc:
            raise OSError(str(exc)) from exc


def get(stage: Stage) -> S3Object | None:
    """The object's bytes and ETag, read in one request; None when there is none."""
    bucket, key = _bucket_key(stage)
    try:
        with _requests(stage, "read"):
            response = _client(stage).get_object(Bucket=bucket, Key=key)
            body = response["Body"].read()
    except PreconditionFailed:  # NoSuchKey
        return None
    return S3Object(body, str(response["ETag"]), dict(response.get("Metadata") or {}))


def head_etag(stage: Stage) -> str | None:
    """The object's current ETag; None when there is none."""
    bucket, key = _bucket_key(stage)
    try:
        with _requests(stage, "look up"):
            return str(_client(stage).head_object(Bucket=bucket, Key=key)["ETag"])
    except PreconditionFailed:  # 404
        return None


def put(
    stage: Stage,
    data: bytes,
    *,
    if_none_match: bool = False,
    if_match: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write the whole object (with ``metadata`` as its user metadata); with ``if_none_match`` only
    when there is none, with ``if_match`` only over that version. Its new ETag; PreconditionFailed
    when the store refused."""
    bucket, key = _bucket_key(stage)
    conditions: dict[str, Any] = {}
    if if_none_match:
        conditions["IfNoneMatch"] = "*"
    if if_match is not None:
        conditions["IfMatch"] = if_match
    extra = {"Metadata": dict(metadata)} if metadata else {}
    with _requests(stage, "conditional write" if conditions else "write", bool(conditions)):
        return str(_client(stage).put_object(Bucket=bucket, Key=key, Body=data, **conditions, **extra)["ETag"])


def delete(stage: Stage, *, if_match: str | None = None) -> None:
    """Delete the object; with ``if_match`` only that version (PreconditionFailed otherwise, or when
    it is gone already)."""
    bucket, key = _bucket_key(stage)
    conditions = {"IfMatch": if_match} if if_match is not None else {}
    with _requests(stage, "conditional delete" if conditions else "delete", bool(conditions)):
        _client(stage).delete_object(Bucket=bucket, Key=key, **conditions)


def list_versions(stage: Stage) -> list[tuple[str, int, str]]:
    """``(relative name, size, ETag)`` of the object at ``stage`` (name ``""``) or of every object
    below it, from the listing alone (S3 lists each key's ETag with its size: no request per
    object). The ETag names the content, so a rewrite with the same size in the same second still
    differs, where ``LastModified`` (to the second) would not."""
    bucket, key = _bucket_key(stage)
    prefix = key.rstrip("/")
    found: list[tuple[str, int, str]] = []
    with _requests(stage, "list"):
        pages = _client(stage).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for item in page.get("Contents", ()):
                name = str(item["Key"])
                if name == prefix:
                    found.append(("", int(item["Size"]), str(item["ETag"])))
                elif name.startswith(prefix + "/") or not prefix:
                    found.append((name[len(prefix) :].lstrip("/"), int(item["Size"]), str(item["ETag"])))
    return found


def store_name(stage: Stage) -> str:
    """The store and bucket ``stage`` is on, as a user would recognize them in a message."""
    cfg = _settings(stage.fs)
    if cfg.get("endpoint_override"):
        where = f"the S3-compatible store at {cfg.get('scheme') or 'https'}://{cfg['endpoint_override']}"
    else:
        where = f"AWS S3 (region {cfg.get('region') or 'from the environment'})"
    return f"bucket {_bucket_key(stage)[0]!r} on {where}"


def _store_key(stage: Stage) -> tuple[str, str]:
    cfg = _settings(stage.fs)
    endpoint = f"{cfg.get('scheme') or 'https'}://{cfg.get('endpoint_override') or ''}|{cfg.get('region') or ''}"
    return endpoint, _bucket_key(stage)[0]


def ignored_conditions(probe_dir: Stage, prefix: str) -> tuple[str, ...]:
    """The conditional requests the commit relies on that the store under ``probe_dir`` does not
    honour, each with how it answered (empty: it honours them all). Asked once per process,
    endpoint and bucket, with objects of the caller's own below ``probe_dir``
    (``<prefix>-<random>``), each removed again.

    A store that honours a condition can only refuse; one that ignores it applies the request, and
    one that does not support it answers with an error saying so (501 NotImplemented, or 400
    InvalidArgument naming the header): both keep no zombie's marker from a newer one. A "honours"
    is therefore certain, while an "ignores" could also be a concurrent clean-up that removed the
    probe object between two requests: the store is asked once more, on a new object, before that
    answer is kept."""
    store = _store_key(probe_dir)
    with _LOCK:
        known = _PROBED.get(store)
    if known is not None:
        return known
    ignored = _probe(probe_dir.child(f"{prefix}-{uuid.uuid4().hex[:16]}"))
    if ignored:
        ignored = _probe(probe_dir.child(f"{prefix}-{uuid.uuid4().hex[:16]}"))
    with _LOCK:
        _PROBED[store] = ignored
    return ignored


def _probe(key: Stage) -> tuple[str, ...]:
    """Create ``key`` (with ``If-None-Match: *``), send it the three conditions that must be
    refused, remove it. A store that rejects the creating request's condition gets no object: the
    two ``If-Match`` requests are then sent to the absent key, which a store that honours them
    refuses just as well."""
    found: dict[str, str] = {}
    create = "If-None-Match on PutObject"
    try:
        put(key, b"batchinfer conditional-write probe", if_none_match=True)
    except ConditionsRejected as exc:
        found[create] = f"answered {exc.answer}"
    try:
        for condition, request in (
            (create, lambda: put(key, b"second", if_none_match=True)),
            ("If-Match on PutObject", lambda: put(key, b"third", if_match=_NO_VERSION)),
            ("If-Match on DeleteObject", lambda: delete(key, if_match=_NO_VERSION)),
        ):
            if condition in found:
                continue
            try:
                request()
            except PreconditionFailed:
                continue
            except ConditionsRejected as exc:
                found[condition] = f"answered {exc.answer}"
                continue
            found[condition] = "applied as a plain request"
    except BaseException:
        with contextlib.suppress(Exception):  # the probe's own error is the one to report
            delete(key)
        raise
    delete(key)
    return tuple(f"{condition} ({how})" for condition, how in found.items())
