"""Jobs across a real 2-node Ray cluster on this machine (``two_node_cluster``: a head and a worker
joined with ``ray start --address``, each with its own temp dir and model cache), with the model in
an S3 registry (``moto_server``): replicas spread over both nodes, each node fetches and verifies
the model once into its own cache, a node without a replica fetches nothing, every row exactly once;
and a node that declares a GPU without CUDA fails the job before the model is loaded."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, JobFailure, last_failure
from airflow_provider_batchinfer.contract.specs import JobSpec
from airflow_provider_batchinfer.registry import MODEL_MANIFEST, ModelRegistry
from tests.models import SlowLength, TextLength, committed_manifest, ticket_job, write_job_file

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
KEY_ID, SECRET = "AKIDMULTINODE", "multinode-secret"


class OtherLength(TextLength):
    """Another class for the other tests' models. Logged from this file, all of them share one sha256
    (it hashes the files, and the source file is the same): each test looks for its own version by
    name in a node's cache."""


@pytest.fixture
def s3_registry(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    options = {"endpoint_url": s3_server, "region": "us-east-1", "max_attempts": 2}
    return ModelRegistry(f"s3://{s3_bucket}/registry", options)


def _run(cluster, registry: ModelRegistry, model, tmp_path: Path, name: str, rows: int = 240, **spec):
    run_dir, job = ticket_job(tmp_path, registry, model, name, rows, ray_address=cluster["address"], **spec)
    job = dataclasses.replace(job, storage_options=dict(registry.storage_options or {}))
    # the test driver has no cache of its own: each node's BATCHINFER_MODEL_CACHE is what counts
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": cluster["address"], "RAY_AUTH_MODE": "token"}
    env.pop("BATCHINFER_MODEL_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", write_job_file(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return run_dir, proc.returncode, proc.stdout + proc.stderr


def _cached(cache: Path) -> list[str]:
    """The model versions (``name/version``) a node's cache holds: ``<sha256>/<location key>/MODEL.json``
    (in-flight downloads are dot-dirs, without a manifest)."""
    manifests = [json.loads(p.read_text()) for p in cache.glob(f"*/*/{MODEL_MANIFEST}")] if cache.exists() else []
    return sorted(f"{m['name']}/{m['version']}" for m in manifests)


def test_replicas_spread_over_both_nodes_each_fetching_the_model_once(two_node_cluster, s3_registry, tmp_path):
    """A replica reports its node once it has loaded the model, and the pool starts scoring only once
    both have: a few rows are enough for both nodes to fetch, verify and place their replica."""
    model = s3_registry.log_model("slow_length", "v1", "python", python_class=SlowLength, signature=SIGNATURE)
    run_dir, rc, out = _run(
        two_node_cluster, s3_registry, model, tmp_path, "spread", rows=40, replicas=2, num_workers=2
    )
    assert rc == 0, out[-5000:]
    manifest = committed_manifest(str(run_dir))
    assert manifest["counts"] == {"input_rows": 40, "output_rows": 40, "error_rows": 0}
    ids = pq.read_table([str(run_dir / f["name"]) for f in manifest["files"]]).column("ticket_id").to_pylist()
    assert sorted(ids) == list(range(40))  # every row exactly once
    pool = manifest["job"]["pool"]
    print(f"2-node pool: {pool}")
    assert (pool["min_replicas"], pool["max_replicas"], pool["num_workers"]) == (2, 2, 2)
    assert {n["node_id"] for n in pool["nodes"]} == set(two_node_cluster["nodes"])  # one replica on each node
    assert [n["replicas"] for n in pool["nodes"]] == [1, 1]
    assert re.search(r"\[batchinfer\] replicas ran: 1 on node [\d.]+ \(\w+\), 1 on node [\d.]+ \(\w+\)", out), out[
        -3000:
    ]
    assert "[batchinfer] actor pool: 2..2 replica(s) over 2 nodes x 1 CPU" in out
    for node in two_node_cluster["nodes"].values():  # each node fetched and verified it once, for itself
        assert _cached(node["cache"]) == ["slow_length/v1"]


def test_a_node_without_a_replica_fetches_nothing(two_node_cluster, s3_registry, tmp_path):
    model = s3_registry.log_model("other_length", "v1", "python", python_class=OtherLength, signature=SIGNATURE)
    run_dir, rc, out = _run(two_node_cluster, s3_registry, model, tmp_path, "single", rows=60)
    assert rc == 0, out[-5000:]
    pool = committed_manifest(str(run_dir))["job"]["pool"]
    assert [n["replicas"] for n in pool["nodes"]] == [1]
    ran_on = pool["nodes"][0]["node_id"]
    for node_id, node in two_node_cluster["nodes"].items():
        assert ("other_length/v1" in _cached(node["cache"])) == (node_id == ran_on), (node_id, ran_on)


def test_a_gpu_that_cuda_cannot_see_fails_the_job_before_the_model_is_loaded(two_node_cluster, s3_registry, tmp_path):
    """The worker node declares ``--num-gpus=1`` on this CPU-only machine: Ray gives the replica the
    GPU, torch sees no CUDA device, and the job fails (permanent) before fetching or loading the model."""
    model = s3_registry.log_model("gpu_length", "v1", "python", python_class=OtherLength, signature=SIGNATURE)
    run_dir, rc, out = _run(two_node_cluster, s3_registry, model, tmp_path, "gpu", rows=40, num_gpus=1, num_cpus=0.5)
    failure = last_failure(out)
    assert rc != 0 and isinstance(failure, JobFailure), out[-5000:]
    assert failure.error.startswith("NoCudaError: replica on Ray node "), failure.error
    assert "was given 1 GPU(s) by Ray (JobSpec.num_gpus=1; GPU ids ['0']" in failure.error, failure.error
    assert "but torch.cuda.is_available() is False there, so the model was not loaded" in failure.error
    assert "or run on CPU with JobSpec(num_gpus=0)" in failure.error and failure.permanent
    assert not (run_dir / SUCCESS_MARKER).exists()
    # the node that gave the replica its GPU never fetched the model: the check runs first
    for node in two_node_cluster["nodes"].values():
        if node["gpus"]:
            assert "gpu_length/v1" not in _cached(node["cache"])


def test_the_vllm_engine_reads_a_verified_node_local_copy_never_the_registry_location(
    s3_registry, tmp_path, monkeypatch
):
    """vLLM itself needs a GPU (not here): what can be checked is the source every node's engine is
    given. An S3 or local registry's version is copied into the node's private model cache and
    re-hashed there; the engine gets that copy's path, never the registry's location
    (tests/component/test_vllm_verified_source.py swaps files under it)."""
    from airflow_provider_batchinfer.contract import ModelRef
    from airflow_provider_batchinfer.runtime.model import llm

    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(tmp_path / "driver-cache"))
    model = ModelRef.from_dict(
        s3_registry.log_model("text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE).to_dict()
    )
    source = llm.model_source(s3_registry, model)
    assert Path(source.path).is_relative_to(tmp_path / "driver-cache") and source.multimodal is False
    assert source.uri == model.uri and Path(source.path, "MODEL.json").exists()
    config = llm.processor_config(source.path, JobSpec(num_gpus=1), multimodal=True)
    assert config["model_source"] == source.path and config["prepare_multimodal_stage"] is True

    local = ModelRegistry(str(tmp_path / "registry"))
    model = ModelRef.from_dict(
        local.log_model("text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE).to_dict()
    )
    source = llm.model_source(local, model)
    assert Path(source.path) != local.local_copy("text_length", "v1") and Path(source.path, "MODEL.json").exists()


def test_an_iceberg_inputs_read_tasks_run_on_both_nodes(two_node_cluster, tmp_path, monkeypatch, capsys):
    """The read a job on the actor pool does first, on the 2-node cluster: a table of four data files
    (four read tasks), spread over the nodes; the job log names both nodes, and every row is read once."""
    import pyarrow as pa

    from airflow_provider_batchinfer.contract.tables import TableInput
    from airflow_provider_batchinfer.runtime.inputs import table_input
    from airflow_provider_batchinfer.store.iceberg.catalog import embedded_catalog, open_catalog, public_catalog
    from tests.runs import job_file

    props = embedded_catalog(str(tmp_path / "stage"), str(tmp_path / "home"))
    catalog = open_catalog(props)
    catalog.create_namespace("raw")
    table = catalog.create_table("raw.tickets", schema=pa.schema([("ticket_id", pa.int64()), ("text", pa.string())]))
    for start in range(0, 40, 10):  # one data file per append
        table.append(pa.table({"ticket_id": pa.array(range(start, start + 10), pa.int64()), "text": ["t"] * 10}))
    snapshot = catalog.load_table("raw.tickets").current_snapshot().snapshot_id
    claim = tmp_path / "claim"
    job = dataclasses.replace(
        job_file(claim, inputs=(str(claim / "_input"),)),
        table_input=TableInput("raw.tickets", public_catalog(props), snapshot, None),
    )
    monkeypatch.setattr(table_input, "MIN_GROUP_ROWS", 1)  # one task per data file
    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster["address"])
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    try:
        (location,) = table_input.read_table_input(job, None)
    finally:
        table_input.leave_ray()
    assert sorted(pq.read_table(location).column("ticket_id").to_pylist()) == list(range(40))
    out = capsys.readouterr().out
    assert "[batchinfer] input: 40 rows of Iceberg table raw.tickets" in out and "read in 4 task(s) on Ray" in out
    (nodes,) = [line for line in out.splitlines() if "[batchinfer] input: read tasks ran on " in line]
    assert "read tasks ran on 2 node(s): " in nodes, nodes
    assert all(node_id in nodes for node_id in two_node_cluster["nodes"]), (nodes, list(two_node_cluster["nodes"]))
