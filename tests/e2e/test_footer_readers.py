"""A job's Parquet listing starts one footer-reading actor per ten input files (``runtime/io.py``).

Ray Data 2.60 lists a Parquet input in a pool of ``FooterReader`` actors it starts for every
``read_parquet``: 32 by default, each a fresh Ray worker process, on two cores most of a small job's
start. The slow test counts the actors a real job started on the session's real Ray cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_batchinfer.runtime.io import FOOTER_ACTORS_ENV, footer_actors
from tests.models import committed_manifest, ticket_job, write_job_file

REPO = Path(__file__).resolve().parents[2]
FOOTER_READER_MODULE = "ray.data._internal.datasource_v2.formats.parquet.footer_reader"


def test_one_footer_reader_per_ten_files_at_most_rays_32():
    assert [footer_actors(n) for n in (0, 1, 10, 11, 95, 320, 10_000)] == [1, 1, 1, 2, 10, 32, 32]


_COUNT_FOOTER_READERS = """
import sys
from ray.util.state import list_actors
print(len(list_actors(address=sys.argv[1], filters=[("class_name", "=", "FooterReader")], limit=10_000)))
"""


def _footer_readers(dashboard: str) -> int:
    """FooterReader actors the cluster has ever had (alive or dead). Asked from a fresh interpreter:
    Ray reads ``RAY_AUTH_MODE`` once per process, and this one may have used Ray before the session's
    token-auth cluster set it (the answer is then "Authentication token is missing")."""
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_FOOTER_READERS, dashboard],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def _run_on_the_pool(tmp_path: Path, registry, model, name: str, env: dict[str, str]) -> Path:
    run_dir, job = ticket_job(tmp_path, registry, model, name, 400, in_driver_max_rows=0)
    done = subprocess.run(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", write_job_file(job)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = committed_manifest(str(run_dir))
    assert manifest is not None and manifest["counts"]["output_rows"] == 400
    # four batches of 100: a steady rate from the progress log, or, in a job shorter than one
    # progress report, from the times the counter actor got the batches' reports
    assert manifest["timings"]["steady_rows_per_s"] > 0
    return run_dir


def test_a_job_of_four_files_lists_them_with_one_actor_and_an_operators_setting_wins(
    ray_cluster, registry, text_length_model, tmp_path
):
    import importlib.util

    import ray

    try:  # the footer-reading actors came with Ray Data's v2 Parquet reader
        has_footer_readers = importlib.util.find_spec(FOOTER_READER_MODULE) is not None
    except ModuleNotFoundError:  # its parent package is missing too
        has_footer_readers = False
    if not has_footer_readers:
        pytest.skip(f"Ray {ray.__version__} lists Parquet files without FooterReader actors")
    env = {k: v for k, v in os.environ.items() if k != FOOTER_ACTORS_ENV}
    before = _footer_readers(ray_cluster["dashboard"])
    _run_on_the_pool(tmp_path, registry, text_length_model, "one", {})  # four input files
    assert _footer_readers(ray_cluster["dashboard"]) - before == 1  # Ray's default would have started 32
    before = _footer_readers(ray_cluster["dashboard"])
    _run_on_the_pool(tmp_path, registry, text_length_model, "three", {**env, FOOTER_ACTORS_ENV: "3"})
    assert _footer_readers(ray_cluster["dashboard"]) - before == 3
