"""Starting or attaching to Ray for one job: the address rule and what every worker's environment gets."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from airflow_provider_batchinfer.contract import JobFile
from airflow_provider_batchinfer.registry import MODEL_CACHE_ENV
from airflow_provider_batchinfer.runtime.replica import DRIVER_CACHE_ENV
from airflow_provider_batchinfer.s3 import worker_env


def ray_init_kwargs(address: str | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """``ray.init`` arguments: the configured cluster, else a fresh local Ray for this job.

    ``ray.init()`` with no address attaches to whatever cluster ``ray start`` last recorded in
    ``/tmp/ray/ray_current_cluster`` (someone else's, or a dead one it then waits on forever), so
    "no address" must say ``"local"`` explicitly."""
    address = address or environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:
        kwargs.update(address="local", include_dashboard=False)
    return kwargs


def init_ray(job: JobFile) -> None:
    """Start (or attach to) Ray; S3 credentials reach the workers from this process's environment,
    never a file. The driver's model cache directory goes as a fallback only
    (``BATCHINFER_DRIVER_MODEL_CACHE``): a node started with its own ``BATCHINFER_MODEL_CACHE`` keeps
    it (a runtime_env variable would override the node's value on every worker)."""
    import ray
    import ray.data

    init_kwargs = ray_init_kwargs(job.ray_address, os.environ)
    env_vars = dict(worker_env())
    if os.environ.get(MODEL_CACHE_ENV):
        env_vars[DRIVER_CACHE_ENV] = os.environ[MODEL_CACHE_ENV]
    if env_vars:
        init_kwargs["runtime_env"] = {"env_vars": env_vars}
    ray.init(**init_kwargs)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
