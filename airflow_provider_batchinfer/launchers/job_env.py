"""What a job on a cluster is given: a public environment (in its ``runtime_env``) and a secret
one (in its secrets package, ``delivery.py``), never the connection's long-lived keys.

- No keys shipped (none on the connection, or ``credentials: worker``): the public S3 settings
  only; each Ray process uses its own chain (and assumes ``role_arn`` itself, when one is set).
- Keys on the connection: a session derived from them through STS for the job's duration
  (``job_session.py``), and with ``role_arn`` that role's session (the runtime is told it already
  holds it, so it does not assume the role again). A store without STS refuses the job.
- The Iceberg catalog's secret properties (``tables/catalog.py: catalog_secret_env``).

Imports no Airflow: the operator and the trigger share the launcher.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_provider_batchinfer.delivery import SECRETS_MODULE_ENV, write_package
from airflow_provider_batchinfer.s3 import ASSUMED_ROLE_ENV, ROLE_KEYS, SECRET_KEYS, credential_env, shipped_credentials


@dataclass(frozen=True)
class JobEnv:
    """``public``: variables that may be listed (endpoint, region, role names). ``secret``: what
    only the job may read. ``expires``: when the job's S3 session ends (None: no session)."""

    public: dict[str, str] = field(default_factory=dict)
    secret: dict[str, str] = field(default_factory=dict, repr=False)
    expires: datetime | None = None

    def runtime_env(self, base: Mapping[str, Any] | None, package: str | None) -> dict[str, Any]:
        """``base`` (the connection's runtime_env) with the public variables, and the secrets
        package at ``package`` (a local directory) among its ``py_modules``."""
        env = dict(base or {})
        env_vars = {**self.public, **dict(env.get("env_vars") or {})}
        if package:
            env["py_modules"] = [*list(env.get("py_modules") or []), package]
            env_vars[SECRETS_MODULE_ENV] = os.path.basename(package)
        if env_vars:
            env["env_vars"] = env_vars
        return env


def job_env(options: Mapping[str, Any], catalog_env: Mapping[str, str], job_timeout: float | None) -> JobEnv:
    """The environment of one job from the connection's storage options (with its keys) and the
    catalog's secret variables. Derives the job's S3 session when keys would be shipped; raises
    ``JobSessionError`` (with what to configure instead) when that is not possible."""
    options = dict(options)
    public_options = {k: v for k, v in options.items() if k not in SECRET_KEYS}
    secret: dict[str, str] = {}
    expires = None
    if shipped_credentials(options):
        from airflow_provider_batchinfer.job_session import derive_session

        session = derive_session(options, job_timeout)
        secret.update(session.env())
        expires = session.expiration
        if session.role_arn:  # the session is the role's: the runtime must not assume it again
            public_options = {k: v for k, v in public_options.items() if k not in ROLE_KEYS}
    public = credential_env(public_options)
    if expires is not None and options.get("role_arn"):
        public[ASSUMED_ROLE_ENV] = str(options["role_arn"])
    secret.update(catalog_env)
    return JobEnv(public=public, secret=secret, expires=expires)


@contextmanager
def secrets_package(env: JobEnv) -> Iterator[str | None]:
    """A private temporary directory holding the job's secrets package while it is submitted (the
    Jobs API client zips and uploads it); None when there is nothing secret to deliver."""
    if not env.secret:
        yield None
        return
    parent = tempfile.mkdtemp(prefix="batchinfer-job-")  # 0700
    try:
        path, _ = write_package(parent, env.secret)
        yield path
    finally:
        shutil.rmtree(parent, ignore_errors=True)
