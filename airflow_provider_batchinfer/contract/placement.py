"""Where a job on the embedded default is scored: in its driver process, or on Ray's actor pool.

Both sides need the answer. The runtime decides (``runtime/engine/in_driver.py``), once it has counted the
rows to score. The local launcher needs it *before* it starts the runtime: a job its driver scores
never touches Ray, so the launcher should not start the embedded Ray for it (about 4 s and ~1 GB on a
2-core worker, most of a small job's cold start). Only the job file is known then, so the launcher
asks :func:`spec_reason`, the half of the rules that does not depend on the rows; with one replica
no rule depends on the rows, which is what :func:`scored_in_driver_whatever_the_rows` checks. Both
halves live here so that the two sides cannot disagree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from airflow_provider_batchinfer.contract.lines import EMBEDDED_RAY_ENV

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract.job_file import JobFile

#: the deployment's default for ``JobSpec.in_driver_max_rows`` (0 turns the in-driver path off)
MAX_ROWS_ENV = "BATCHINFER_IN_DRIVER_MAX_ROWS"
DEFAULT_MAX_ROWS = 1_000


def max_rows_setting(spec_value: int | None, environ: Mapping[str, str] = os.environ) -> int | None:
    """The job's own ``in_driver_max_rows``, else the deployment's, else 1,000; None when the
    deployment's value is not a whole number >= 0 (the runtime refuses it with a message)."""
    if spec_value is not None:
        return spec_value
    raw = environ.get(MAX_ROWS_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_ROWS
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


#: the flavor whose jobs run on an LLM engine (vLLM or transformers)
LLM_FLAVOR = "text_generation"


def chosen_engine(spec_engine: str | None, connection_engine: str | None, num_gpus: float) -> str:
    """The engine rule, the one place it lives (``runtime/llm.resolve_engine`` adds its checks):
    ``JobSpec.engine``, else the connection's ``llm_engine``, else vLLM exactly when the job has GPUs."""
    return spec_engine or connection_engine or ("vllm" if num_gpus > 0 else "transformers")


def llm_engine(job: JobFile) -> str | None:
    """The engine a text generation job runs on; None for every other flavor."""
    if job.model.flavor != LLM_FLAVOR:
        return None
    return chosen_engine(job.job_spec.engine, job.llm_engine, job.job_spec.num_gpus)


def spec_reason(job: JobFile, limit: int, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the job's spec alone sends it to the actor pool, whatever its rows; None when the driver
    may score it. ``limit``: the job's ``in_driver_max_rows`` (:func:`max_rows_setting`)."""
    spec = job.job_spec
    reasons = [
        (environ.get(EMBEDDED_RAY_ENV) != "1", "not on the embedded Ray"),
        (limit == 0, "in_driver_max_rows=0"),
        (spec.num_gpus > 0, "GPU replicas"),
        (llm_engine(job) == "vllm", "the vLLM engine"),
        (bool(spec.reuse), "incremental reuse"),
        (spec.max_cost is not None or spec.max_output_tokens_total is not None, "a budget guard"),
    ]
    return next((why for hit, why in reasons if hit), None)


def rows_reason(job: JobFile, rows: int, limit: int) -> str | None:
    """Why the rows to score send a job the spec allows in the driver to the pool: more replicas
    than one and more rows than ``in_driver_max_rows``."""
    replicas = job.job_spec.replicas
    if replicas > 1 and rows > limit:
        return f"replicas={replicas} and {rows:,} rows to score, more than in_driver_max_rows={limit:,}"
    return None


def scored_in_driver_whatever_the_rows(job: JobFile, environ: Mapping[str, str]) -> bool:
    """True when the runtime started with ``environ`` will score this job in its driver process
    however many rows it finds, so it needs no Ray: one replica and nothing in the spec that needs
    the pool. ``environ`` is the runtime's (with ``EMBEDDED_RAY_ENV`` set by the launcher)."""
    limit = max_rows_setting(job.job_spec.in_driver_max_rows, environ)
    if limit is None or job.job_spec.replicas != 1:
        return False
    return spec_reason(job, limit, environ) is None
