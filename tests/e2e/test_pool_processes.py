"""A job on the actor pool starts no Ray worker process beyond its replicas and its write tasks.

A small input (``runtime/inputs/small_input.py``) is read in the driver and handed to Ray Data as one block:
no listing task, footer-reading actor, read task or write task starts for it. A larger one is read with
``ray.data.read_parquet``, whose footer readers are sized to its files (``runtime/output/parts.py``), in the
replicas themselves (``runtime/engine/pool_dataset.py``). The
replicas report to the cluster's one usage board (``runtime/model/usage_board.py``) instead of a counter
actor per job. The test counts what two real jobs started on the session's real Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from airflow_provider_batchinfer.runtime.output.parts import footer_actors
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


def _pad(directory: Path, column_bytes: int) -> None:
    """Give each input file a column the model never reads (passed through), making it ``column_bytes``
    larger."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for file in sorted(directory.glob("*.parquet")):
        table = pq.read_table(file)
        pads = [os.urandom(column_bytes // table.num_rows // 2).hex() for _ in range(table.num_rows)]
        pq.write_table(table.append_column("pad", pa.array(pads)), file)


def _run_on_the_pool(tmp_path: Path, registry, model, name: str, pad_bytes: int = 0) -> dict:
    run_dir, job = ticket_job(tmp_path, registry, model, name, 400, in_driver_max_rows=0)  # four input files
    if pad_bytes:
        _pad(tmp_path / f"in-{name}", pad_bytes)
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
    small = "input read in the driver: 400 rows" in done.stdout
    assert small == (not pad_bytes), done.stdout[-3000:]
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


def test_a_small_input_starts_no_read_task_and_a_larger_one_one_footer_reader_and_both_share_one_usage_board(
    ray_cluster, registry, text_length_model, tmp_path
):
    from airflow_provider_batchinfer.runtime.inputs.small_input import byte_limit

    before = _cluster_state(ray_cluster["dashboard"])
    first = _run_on_the_pool(tmp_path, registry, text_length_model, "small")
    middle = _cluster_state(ray_cluster["dashboard"])
    # the same rows, with a column the model never reads past the limit: read by read_parquet
    second = _run_on_the_pool(tmp_path, registry, text_length_model, "large", pad_bytes=byte_limit() // 3)
    after = _cluster_state(ray_cluster["dashboard"])
    small_actors, small_tasks = _new(middle["actors"], before["actors"]), _new(middle["tasks"], before["tasks"])
    actors, tasks = _new(after["actors"], middle["actors"]), _new(after["tasks"], middle["tasks"])
    # per job: its replica; the file read: a footer reader; once per cluster (new here if no pool job
    # ran on it before): the usage board and Ray Data's own detached actors
    assert [a for a in small_actors if a not in ONCE_PER_CLUSTER] == ["MapWorker(MapBatches(MeteredReplica))"]
    # the file read runs in the replica itself: Ray Data fused it into the replica's actor, and no
    # read task of its own ran
    fused = "MapWorker(ReadFilesParquetV2->MapBatches(MeteredReplica))"
    assert [a for a in actors if a not in ONCE_PER_CLUSTER] == ["FooterReader", fused]
    assert not any("ListFiles" in t or "ReadFiles" in t or "ReadParquet" in t for t in small_tasks), small_tasks
    # nor a write task: the driver that read the small input writes its parts (io.write_here)
    assert not any(t.startswith("Write") for t in small_tasks), small_tasks
    assert any(t.startswith("Write") for t in tasks), tasks
    assert not any(t.startswith(("ReadFiles", "ReadParquet")) for t in tasks), tasks
    assert any(t.startswith(fused) for t in tasks), tasks
    assert all(after["actors"].count(a) <= 1 for a in ONCE_PER_CLUSTER) and "UsageBoard" in after["actors"]
    assert "UsageCounter" not in after["actors"]
    # the same rows come out in the same parts either way
    assert [f["rows"] for f in first["files"]] == [f["rows"] for f in second["files"]], (
        first["files"],
        second["files"],
    )
    for manifest in (first, second):
        # the progress and latencies the replicas reported reached each job's own entry on the board
        assert manifest["timings"]["steady_rows_per_s"] > 0
        assert manifest["usage"]["batches"] > 0, manifest["usage"]
