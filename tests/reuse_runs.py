"""Committed runs with a ``reuse`` section, for the tests that choose the earlier run to reuse from
(tests/e2e/test_incremental.py, tests/unit/test_reuse_source.py): a real part, a key file, a ``_job.json``
claim and a ``_SUCCESS`` whose store time (mtime) is set, since commit order is what the store says."""

from __future__ import annotations

import dataclasses
import os
from datetime import datetime
from pathlib import Path

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, JobFile, Manifest, RunOwner
from airflow_provider_batchinfer.contract.reuse import KEY_SCHEME, IndexFile, ReuseInfo, key_file_name
from airflow_provider_batchinfer.runtime.incremental.keys import context_digest
from tests.runs import OWNER, job_file, manifest_for, write_part

CONTEXT = context_digest(
    model="m/v1",
    model_sha256="0" * 64,
    flavor="python",
    params={},
    inputs=[("text", "text", "string")],
    outputs={"length": "int64"},
    engine=None,
)


def reuse_manifest(run_dir: Path, rows: int = 3, **reuse_fields) -> Manifest:
    """A manifest for one real part of ``rows`` rows with a reuse section (``context`` etc. overridable)."""
    entry = write_part(run_dir, "part-00000-t01a.parquet", list(range(rows)))
    index = IndexFile(key_file_name(entry.name), entry.name, 10, rows, "a" * 64, reuse_fields.pop("reused", 1))
    fields = {
        "mode": "unchanged",
        "scheme": KEY_SCHEME,
        "context": CONTEXT,
        "index": (index,),
        "source_run": None,
        "reused_rows": index.reused_rows,
        "scored_rows": rows - index.reused_rows,
    }
    info = ReuseInfo(**{**fields, **reuse_fields})
    return dataclasses.replace(manifest_for(run_dir, (entry,)), reuse=info)


def owner(run_id: str = "run1", **changes) -> RunOwner:
    return dataclasses.replace(OWNER, run_id=run_id, **changes)


def source_job(base: Path, run_id: str = "today", **owner_changes) -> JobFile:
    """The job that looks for an earlier run: this task's run ``run_id`` under ``base``."""
    location = base / run_id
    if owner_changes.get("map_index", -1) >= 0:
        location = location / f"map-{owner_changes['map_index']}"
    return job_file(location, owner=owner(run_id, **owner_changes))


def committed(
    base: Path,
    key: str,
    committed_at: str,
    context: str = CONTEXT,
    with_keys: bool = True,
    *,
    finished_at: str | None = None,
    writer: RunOwner | None = None,
    claimant: RunOwner | None = None,
    claim: bool = True,
    map_index: int = -1,
) -> Path:
    """A committed run directory ``<base>/<key>[/map-<i>]``: a part, its key file, a reuse section, a
    claim by ``claimant`` (default: the writer) naming the committing attempt, and a ``_SUCCESS``
    written by ``writer`` (default: this task) whose mtime is ``committed_at`` and whose
    ``finished_at`` is ``finished_at`` (default: ``committed_at``)."""
    run = base / key / (f"map-{map_index}" if map_index >= 0 else "")
    run = Path(str(run).rstrip("/"))
    manifest = reuse_manifest(run, context=context)
    key_path = run / key_file_name(manifest.files[0].name)
    key_path.parent.mkdir(parents=True, exist_ok=True)
    if with_keys:
        key_path.write_bytes(b"k" * 10)
    writer = writer or owner(key, map_index=map_index)
    manifest = dataclasses.replace(manifest, finished_at=finished_at or committed_at, airflow=writer)
    if claim:
        claimed = job_file(run, attempt=manifest.job.attempt, owner=claimant or writer)
        (run / JOB_SPEC_FILE).write_text(claimed.to_json())
    marker = run / SUCCESS_MARKER
    marker.write_text(manifest.to_json())
    stamp = datetime.fromisoformat(committed_at).timestamp()
    os.utime(marker, (stamp, stamp))
    return run
