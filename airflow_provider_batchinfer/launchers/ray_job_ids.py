"""Who a Ray job belongs to, read back from the Jobs API: its submission id and its metadata (the
task instance, the attempt, the job's identity), how its driver log is read in whole lines, and
the small adapters around Ray's Jobs API client.

Imports neither Airflow nor Ray: the launcher, the trigger and the tests share it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.store.identity import task_key

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract import RunOwner

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


#: job metadata keys (beside dag_id, task_id, run_id, map_index, try_number, attempt)
TASK_KEY = "batchinfer_task"
IDENTITY_KEY = "batchinfer_identity"


def submission_id_for(owner: RunOwner, attempt: str, identity: str | None = None) -> str:
    """``batchinfer-<dag>-<task>-<identity, 128 bits>-<attempt>``: readable, and distinct for every
    submission (the attempt id is unique; Ray never accepts a submission id twice). Without an
    identity the task key stands in. Re-attaching never derives it: it reads it from ``_job.json``."""
    readable = f"{_UNSAFE.sub('_', owner.dag_id)[:40]}-{_UNSAFE.sub('_', owner.task_id)[:40]}"
    key = (identity or task_key(owner))[:32]
    return f"batchinfer-{readable}-{key}-{_UNSAFE.sub('_', attempt)}"


def job_metadata(owner: RunOwner, attempt: str, identity: str | None) -> dict[str, str]:
    """What a submitted job carries, so a later try can find (and stop) its task's jobs."""
    return {
        "dag_id": owner.dag_id,
        "task_id": owner.task_id,
        "run_id": owner.run_id,
        "map_index": str(owner.map_index),
        "try_number": str(owner.try_number),
        "attempt": attempt,
        TASK_KEY: task_key(owner),
        IDENTITY_KEY: identity or "",
    }


def belongs_to(metadata: Mapping[str, str], owner: RunOwner) -> bool:
    """Whether a job's metadata names this task instance (jobs submitted before the task key was
    recorded: by dag, task, run and map index)."""
    if TASK_KEY in metadata:
        return metadata[TASK_KEY] == task_key(owner)
    return (metadata.get("dag_id"), metadata.get("task_id"), metadata.get("run_id")) == (
        owner.dag_id,
        owner.task_id,
        owner.run_id,
    ) and metadata.get("map_index", "-1") == str(owner.map_index)


def new_log_lines(text: str, offset: int, final: bool) -> tuple[list[str], int]:
    """The complete lines of a job's log after ``offset`` (all of the rest when ``final``) and the
    offset after them: a line still being written is forwarded on a later look, whole."""
    fresh = text[offset:]
    complete = fresh if final else fresh[: fresh.rfind("\n") + 1]
    return complete.splitlines(), offset + len(complete)


@contextmanager
def env_without(*names: str) -> Iterator[None]:
    """JobSubmissionClient prefers RAY_ADDRESS from the environment over the address it is given
    (Ray 2.60, ray.dashboard.utils.get_address_for_submission_client); on a worker that also runs
    local-launcher jobs that variable points at a GCS, not at the Jobs API we were configured with."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def status_text(status: Any) -> str:
    """A Jobs API status as its text (the client returns an enum, the HTTP API a string)."""
    return str(status.value if hasattr(status, "value") else status)
