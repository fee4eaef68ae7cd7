"""A job on the actor pool starts no Ray worker process beyond its replicas and its read/write tasks.

The driver reads every input footer before any compute, so the pool's reads are planned from them
(``runtime/parquet_read.py``) instead of ``ray.data.read_parquet``, which lists the files and reads
the footers again in a listing task and footer-reading actors of its own. The replicas report to the
cluster's one usage board (``runtime/usage_board.py``) instead of a counter actor per job. The test
counts what two real jobs started on the session's real Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from airflow_provider_batchinfer.runtime.io import footer_actors
from tests.models import committed_manifest, ticket_job, write_job_file

REPO = Path(__file__).resolve().parents[2]
ONCE_PER_CLUSTER = {"UsageBoard", "ActorLocationTracker", "_AutoscalingCoordinatorActor", "_StatsActor"}


def test_one_footer_reader_per_200_files_at_most_rays_32():
    assert [footer_actors(n) for n in (0, 1, 40, 200, 201, 1_000, 6_400, 10_000)] == [1, 1, 1, 1, 2, 5, 32, 32]


_COUNT = """
import json, sys
from ray.util.state import list_actors, list_tasks
actors = [a.class_name for a in list_actors(address=sys.argv[1], limit=10_000)]
tasks = [t.name for t in list_tasks(address=sys.argv[1], limit=10_000)]
print(json.dumps({"actors": actors, "tasks": tasks}))
"""


def _cluster_state(dashboard: str) -> dict:
    """Every actor class and task name the cluster has had (alive or done). Asked from a fresh
    interpreter: Ray reads ``RAY_AUTH_MODE`` once per process, and this one may have used Ray before
    the session's token-auth cluster set it."""
    out = subprocess.run(
        [sys.executable, "-c", _COUNT, dashboard],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _run_on_the_pool(tmp_path: Path, registry, model, name: str) -> dict:
    run_dir, job = ticket_job(tmp_path, registry, model, name, 400, in_driver_max_rows=0)  # four input files
    done = subprocess.run(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", write_job_file(job)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = committed_manifest(str(run_dir))
    assert manifest is not None and manifest["counts"]["output_rows"] == 400
    return manifest


def _new(after: list[str], before: list[str]) -> list[str]:
    left = list(before)
    added = []
    for name in after:
        if name in left:
            left.remove(name)
        else:
            added.append(name)
    return sorted(added)


def test_two_jobs_start_a_replica_and_one_footer_reader_each_and_share_one_usage_board(
    ray_cluster, registry, text_length_model, tmp_path
):
    before = _cluster_state(ray_cluster["dashboard"])
    first = _run_on_the_pool(tmp_path, registry, text_length_model, "one")
    second = _run_on_the_pool(tmp_path, registry, text_length_model, "two")
    after = _cluster_state(ray_cluster["dashboard"])
    actors, tasks = _new(after["actors"], before["actors"]), _new(after["tasks"], before["tasks"])
    # per job: its replica; once per cluster (new here if no pool job ran on it before): the usage
    # board and Ray Data's own detached actors
    per_job = ["FooterReader", "MapWorker(MapBatches(MeteredReplica))"] * 2  # four input files each
    assert [a for a in actors if a not in ONCE_PER_CLUSTER] == sorted(per_job), actors
    assert all(actors.count(a) <= 1 for a in ONCE_PER_CLUSTER) and "UsageBoard" in after["actors"], actors
    assert "UsageCounter" not in actors and any("ReadFiles" in t or "ReadParquet" in t for t in tasks), tasks
    for manifest in (first, second):
        # the progress and latencies the replicas reported reached each job's own entry on the board
        assert manifest["timings"]["steady_rows_per_s"] > 0
        assert manifest["usage"]["batches"] > 0, manifest["usage"]
