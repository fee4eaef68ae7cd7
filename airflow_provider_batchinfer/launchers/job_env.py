"""What a job on a cluster is given: a public environment (in its ``runtime_env``) and a secret
one (in its secrets package, ``delivery.py``), never the connection's long-lived keys.

- No keys shipped (none on the connection, or ``credentials: worker``): the public S3 settings
  only; each Ray process uses its own chain (and assumes ``role_arn`` itself, when one is set).
- Keys on the connection and a job that reads or writes a location on S3 (:func:`needs_s3_session`):
  a session derived from them through STS for the job's duration (``job_session.py``), and with
  ``role_arn`` that role's session (the runtime is told it already holds it, so it does not assume
  the role again). A store without STS refuses such a job. A job whose every location is local
  (stage, registry, inputs, a table's warehouse, the allowed roots) needs no S3 credential: STS is
  not asked and no key is shipped.
- The Iceberg catalog's secret properties (``store/iceberg/catalog.py: catalog_secret_env``).

Imports no Airflow: the operator and the trigger share the launcher.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_provider_batchinfer.store.delivery import SECRETS_MODULE_ENV, write_package
from airflow_provider_batchinfer.store.s3 import (
    ASSUMED_ROLE_ENV,
    ROLE_KEYS,
    SECRET_KEYS,
    credential_env,
    shipped_credentials,
)


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


def job_locations(
    run_dir: str,
    model_uri: str,
    roots: Iterable[str],
    inputs: Sequence[str] | None,
    catalog: Mapping[str, str] | None,
) -> tuple[str, ...]:
    """Every place a job may read or write: its run directory, the model version's directory, the
    roots its rows may reference files under (the stage root and ``allowed_roots``), its Parquet
    inputs, and for an Iceberg table (input or output) the catalog's warehouse, or its URI when it
    names none (the catalog then decides where tables live)."""
    found = [run_dir, model_uri, *roots, *(inputs or ())]
    if catalog is not None:
        found.append(catalog.get("warehouse") or catalog.get("uri") or "")
    return tuple(found)


def _local(location: str) -> bool:
    return location.startswith(("/", "file:/"))


def needs_s3_session(locations: Iterable[str] | None) -> bool:
    """Whether a job with these locations (:func:`job_locations`) may need S3 credentials: any
    location that is not a local path (absolute, or a ``file:`` URI) counts, a catalog named only
    by a name or a REST URI included, and so does not knowing the locations (None)."""
    return locations is None or not all(_local(location) for location in locations)


def job_env(
    options: Mapping[str, Any],
    catalog_env: Mapping[str, str],
    job_timeout: float | None,
    uses_s3: bool = True,
) -> JobEnv:
    """The environment of one job from the connection's storage options (with its keys) and the
    catalog's secret variables. Derives the job's S3 session when keys would be shipped to a job
    that ``uses_s3``; raises ``JobSessionError`` (with what to configure instead) when that is not
    possible. A job that uses no S3 gets the public settings only, and STS is not asked."""
    options = dict(options)
    public_options = {k: v for k, v in options.items() if k not in SECRET_KEYS}
    secret: dict[str, str] = {}
    expires = None
    if uses_s3 and shipped_credentials(options):
        from airflow_provider_batchinfer.launchers.job_session import derive_session

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
