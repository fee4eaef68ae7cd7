"""Starting or attaching to Ray for one job: the address rule and what every worker's environment gets.

Ray workers do not inherit the driver's environment: a worker's ``AWS_*`` keys must be handed to it.
The keys never go through ``ray.init``'s ``runtime_env``: Ray records that with the job (``ray list
jobs``, the dashboard, the Jobs API), and under the Jobs API it must not repeat a variable the
job's own ``runtime_env`` sets (Ray refuses to merge the two, and prints both, values included).
Keys (and a SQL input's database URL) reach each worker through a ``worker_process_setup_hook`` that sets them in its environment
before it runs anything; Ray keeps the hook in the cluster's internal store, not in the job's
metadata. Public settings (endpoint, region) go as ``env_vars``, less those the job's ``runtime_env``
already sets. A job with nothing to hand its workers sets no ``runtime_env`` at all: with one, Ray starts
each worker through its runtime-env setup (a second Python start and the runtime-env agent's round
trip) and cannot use the workers the raylet prestarted, so a small job waits for more and slower worker
starts (the driver's model cache therefore goes to the replicas as an argument, ``pool_dataset.replica_kwargs``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from airflow_provider_batchinfer.contract import JobFile
from airflow_provider_batchinfer.contract.lines import EMBEDDED_RAY_ENV, EMBEDDED_RAY_READY_ENV
from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.store.redact import SECRET_ENV
from airflow_provider_batchinfer.store.s3 import worker_env

#: set by the Ray Jobs API in a job's driver: the job's config, its runtime_env included
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
#: a Ray this job starts keeps idle task workers up to this many workers (actors included): by default
#: the raylet kills one idle for 1 s past the node's CPU count, which a pool job's actors exceed on a
#: small machine, and each read and write task then starts a fresh Python process (the embedded Ray's
#: head gets the same, ``launchers/embedded/embedded_ray.py``). A named cluster's nodes keep their own setting
#: (``RAY_num_workers_soft_limit`` where they start)
WORKER_SOFT_LIMIT = 64
#: how long a job started beside the embedded Ray's start waits for it: past the launcher's own wait
#: (``embedded_ray.START_TIMEOUT_S``), after which the launcher has stopped the job anyway
READY_TIMEOUT_S = 180.0


def ray_init_kwargs(address: str | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """``ray.init`` arguments: the configured cluster, else a fresh local Ray for this job.

    ``ray.init()`` with no address attaches to whatever cluster ``ray start`` last recorded in
    ``/tmp/ray/ray_current_cluster`` (someone else's, or a dead one it then waits on forever), so
    "no address" must say ``"local"`` explicitly."""
    address = address or environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:  # idle task workers kept, as on the embedded Ray's head (WORKER_SOFT_LIMIT)
        kwargs.update(
            address="local", include_dashboard=False, _system_config={"num_workers_soft_limit": WORKER_SOFT_LIMIT}
        )
    return kwargs


def cluster_can_grow(job: JobFile, environ: Mapping[str, str]) -> bool:
    """False for a Ray that runs on this machine alone and never adds a node: the embedded default
    (``BATCHINFER_EMBEDDED_RAY``) and a private Ray this job starts (``"local"``). There a job whose
    minimum no node could ever hold fails at once instead of waiting ``resource_wait_s`` for nothing."""
    if environ.get(EMBEDDED_RAY_ENV) == "1":
        return False
    return ray_init_kwargs(job.ray_address, environ)["address"] != "local"


def _job_env_vars(environ: Mapping[str, str]) -> set[str]:
    """The variables the job's own ``runtime_env`` sets (a Jobs API driver's job config): Ray refuses
    a ``ray.init`` that sets any of them again."""
    try:
        config = json.loads(environ.get(JOB_CONFIG_ENV) or "{}")
    except ValueError:
        return set()
    runtime_env = config.get("runtime_env") or {}
    return set(runtime_env.get("env_vars") or {}) if isinstance(runtime_env, dict) else set()


def _worker_env_hook(values: Mapping[str, str]) -> Callable[[], None]:
    """A ``worker_process_setup_hook`` that puts ``values`` into each worker's environment."""
    frozen = dict(values)

    def batchinfer_worker_env() -> None:
        os.environ.update(frozen)

    return batchinfer_worker_env


def worker_runtime_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """``ray.init``'s ``runtime_env``: credentials through the setup hook only, public settings as
    ``env_vars`` unless the job's ``runtime_env`` sets them already. Empty: nothing to add."""
    forwarded = dict(worker_env(environ))
    secret = {k: v for k, v in forwarded.items() if k in SECRET_ENV}
    if environ.get(SQL_URL_ENV):  # a SQL input's shards connect from the workers
        secret[SQL_URL_ENV] = environ[SQL_URL_ENV]
    taken = _job_env_vars(environ)
    public = {k: v for k, v in forwarded.items() if k not in SECRET_ENV and k not in taken}
    runtime_env: dict[str, Any] = {}
    if public:
        runtime_env["env_vars"] = public
    if secret:
        runtime_env["worker_process_setup_hook"] = _worker_env_hook(secret)
    return runtime_env


def wait_for_embedded_ray(environ: Mapping[str, str], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Return once the embedded Ray this job was started beside is up (the launcher creates the file
    ``EMBEDDED_RAY_READY_ENV`` names); at once when the job was started on a Ray that was up."""
    ready = environ.get(EMBEDDED_RAY_READY_ENV)
    if not ready:
        return
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready):
        if time.monotonic() > deadline:
            raise JobError(f"the embedded Ray this job was started beside was not up after {timeout_s:g}s ({ready})")
        time.sleep(0.05)


def init_ray(job: JobFile) -> None:
    """Start (or attach to) Ray; S3 credentials reach the workers from this process's environment
    (:func:`worker_runtime_env`), never a file or the job's metadata."""
    import ray
    import ray.data

    wait_for_embedded_ray(os.environ)
    init_kwargs = ray_init_kwargs(job.ray_address, os.environ)
    runtime_env = worker_runtime_env(os.environ)
    if runtime_env:
        init_kwargs["runtime_env"] = runtime_env
    ray.init(**init_kwargs)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
