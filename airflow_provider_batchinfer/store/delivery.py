"""How a job on a cluster receives its secrets without any of them becoming job metadata.

The Ray Jobs API lists a job's ``runtime_env``, entrypoint and metadata back to every client, and
its dashboard shows them. What it does not hand back is the content of a package uploaded with the
job (``GET /api/packages/...`` answers only whether one exists). So the Airflow side writes the
job's secret environment (its S3 session, the Iceberg catalog's secret properties) into a one-job
Python package (:func:`write_package`), the Jobs API client uploads it as one of the job's
``py_modules``, and the job's listing shows only the package's content-hash URI and the package's
name (``BATCHINFER_SECRETS_MODULE``, a random name). The runtime reads it first thing
(:func:`apply_delivered_env`) and its Ray workers get the values from the driver
(``runtime/attach.py``), not from the ``runtime_env``.

Shared by both sides: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
from collections.abc import Mapping, MutableMapping

#: names the job's secrets package in its runtime_env's env_vars (not a secret itself)
SECRETS_MODULE_ENV = "BATCHINFER_SECRETS_MODULE"
_PREFIX = "batchinfer_secrets_"
_ENV_FILE = "env.json"
_NAME = re.compile(rf"^{_PREFIX}[0-9a-f]{{32}}$")


class DeliveryError(RuntimeError):
    """The job names a secrets package it cannot find or read."""


def write_package(parent: str, env: Mapping[str, str]) -> tuple[str, str]:
    """A package directory under ``parent`` (which the caller created private and removes) holding
    ``env``: its path and module name. Files are written owner-only. The name is written inside
    too: Ray names an uploaded package by a hash of its files' content, not of the directory's
    name, so two jobs given the same values (the same catalog secrets, say) would share one package
    and the second would look for a module name that is not in it."""
    name = _PREFIX + secrets.token_hex(16)
    path = os.path.join(parent, name)
    os.mkdir(path, 0o700)
    for filename, text in (("__init__.py", ""), (_ENV_FILE, json.dumps({"package": name, "env": dict(env)}))):
        fd = os.open(os.path.join(path, filename), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
    return path, name


def read_package(name: str) -> dict[str, str]:
    """The environment the package ``name`` (on this process's ``sys.path``, as Ray puts a job's
    ``py_modules``) holds."""
    if not _NAME.match(name):
        raise DeliveryError(f"{SECRETS_MODULE_ENV}={name!r} is not a batchinfer secrets package name")
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DeliveryError(
            f"the job's secrets package {name} is not on this process's path: the job was submitted with it as "
            "a py_modules entry of its runtime_env; a runtime_env that replaces py_modules drops it"
        )
    with open(os.path.join(locations[0], _ENV_FILE)) as src:
        data = json.load(src)
    if data.get("package") != name:
        raise DeliveryError(f"the job's secrets package {name} holds another job's values")
    return {str(k): str(v) for k, v in data["env"].items()}


def apply_delivered_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put the job's delivered secrets into this process's environment (where S3 clients and
    pyiceberg read them); returns them (empty when the job was given none)."""
    target = os.environ if environ is None else environ
    name = target.get(SECRETS_MODULE_ENV)
    if not name:
        return {}
    env = read_package(name)
    target.update(env)
    return env
