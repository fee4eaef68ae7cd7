"""The optimized backend for TorchScript models: ONNX Runtime, fp32 or dynamic INT8, exported
once per model version and node, guarded by how well its outputs agree with PyTorch's.

The jobs run the real runtime in a subprocess, scored in its driver as on the embedded Ray (no Ray
at all: the address given is one nothing listens on), so the test can ask that process whether it
ever imported torch."""

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

from airflow_provider_batchinfer.runtime.engine.in_driver import EMBEDDED_ENV
from airflow_provider_batchinfer.runtime.model.flavors import load_predictor
from airflow_provider_batchinfer.runtime.model.flavors.optimized import optimized_cache, optimized_torchscript
from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_cache import BackendRefusedError
from tests.models import committed_manifest, job_file, tiny_mlp, write_job_file

REPO = Path(__file__).resolve().parents[2]
FEATURES = [f"f{i}" for i in range(8)]
SIGNATURE = {"inputs": dict.fromkeys(FEATURES, "float32"), "outputs": {"score": "float32"}}


def _two_heads():
    """A network returning a tuple: a score and a 3-wide vector (two signature outputs)."""
    import torch

    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.body = torch.nn.Linear(len(FEATURES), 16)
            self.score = torch.nn.Linear(16, 1)
            self.vector = torch.nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.body(x))
            return torch.sigmoid(self.score(h)), self.vector(h)

    return torch.jit.script(TwoHeads().eval())


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The tiny MLP logged in a registry, its verified local copy, and a node cache."""
    from airflow_provider_batchinfer.registry import ModelRegistry
    from airflow_provider_batchinfer.registry.fetch import fetch_version

    root = tmp_path_factory.mktemp("ts-onnx")
    registry = ModelRegistry(str(root / "registry"))
    version = registry.log_model("mlp", "v1", "torchscript", tiny_mlp(len(FEATURES)), signature=SIGNATURE)
    model_dir, manifest = fetch_version(version.uri, version.sha256)
    assert manifest is not None
    return {
        "registry": registry,
        "version": version,
        "dir": model_dir,
        "manifest": {**manifest, "sha256": version.sha256},
        "cache": root / "cache",
    }


def _features(rows: int, seed: int = 7) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({f: rng.standard_normal(rows).astype(np.float32) for f in FEATURES})


# --- export, cache, guard (no Ray) ---------------------------------------------------------------------------
def test_the_export_is_made_once_per_model_version_and_scores_as_pytorch_does(mlp):
    lines: list[str] = []
    load = optimized_torchscript.load
    predict = load(
        mlp["dir"], mlp["manifest"], "cpu", 2, 4096, backend="onnx", cache_root=mlp["cache"], say=lines.append
    )
    assert lines[0].startswith("[batchinfer] backend onnx: exported in ") and "mean cosine 1.0000" in lines[0]
    directory = optimized_torchscript.optimized_cache.optimized_dir(mlp["cache"], mlp["version"].sha256, "onnx", 1)
    info = json.loads((directory / "info.json").read_text())
    assert info["width"] == len(FEATURES) and info["outputs"] == 1 and info["tupled"] is False
    assert info["sample_rows"] == optimized_torchscript.SAMPLE_ROWS and info["max_abs_diff"] < 1e-5
    stamp = (directory / "model.onnx").stat().st_mtime_ns

    batch = _features(10_000)  # three model calls of 4,096 rows
    mine = predict(batch, {})["score"]
    reference = load_predictor(mlp["dir"], mlp["manifest"], "cpu", 2, 4096)(batch, {})["score"]
    assert mine.shape == reference.shape == (10_000,) and np.abs(mine - reference).max() < 1e-5

    again: list[str] = []
    load(mlp["dir"], mlp["manifest"], "cpu", 1, 4096, backend="onnx", cache_root=mlp["cache"], say=again.append)
    assert "backend onnx: cached export" in again[0] and (directory / "model.onnx").stat().st_mtime_ns == stamp
    assert not any(p.name.startswith(".onnx-") and p.is_dir() for p in directory.parent.iterdir())


def test_a_model_returning_a_tuple_keeps_its_outputs_apart(tmp_path):
    from airflow_provider_batchinfer.registry import ModelRegistry
    from airflow_provider_batchinfer.registry.fetch import fetch_version

    signature = {"inputs": SIGNATURE["inputs"], "outputs": {"probability": "float32", "vector": "list<float32>"}}
    registry = ModelRegistry(str(tmp_path / "registry"))
    version = registry.log_model("heads", "v1", "torchscript", _two_heads(), signature=signature)
    model_dir, manifest = fetch_version(version.uri, version.sha256)
    manifest = {**manifest, "sha256": version.sha256}
    batch = _features(300)
    mine = optimized_torchscript.load(model_dir, manifest, "cpu", 1, 128, backend="onnx", cache_root=tmp_path / "c")(
        batch, {}
    )
    reference = load_predictor(model_dir, manifest, "cpu", 1, 128)(batch, {})
    assert mine["probability"].shape == (300,) and mine["vector"].shape == (300, 3)
    for name in ("probability", "vector"):
        assert np.abs(mine[name] - reference[name]).max() < 1e-5


def test_the_guard_compares_centred_outputs_so_a_lost_ranking_is_caught():
    rng = np.random.default_rng(0)
    probability = 0.5 + 0.01 * rng.standard_normal((500, 1))  # all near 0.5: plain cosine ~1.0 regardless
    shuffled = rng.permutation(probability)
    lost = optimized_torchscript.agreement([probability], [shuffled])
    assert lost["cosine_mean"] < 0.3 and lost["max_abs_diff"] > 0.01
    noisy = optimized_torchscript.agreement([probability], [probability + 1e-4 * rng.standard_normal((500, 1))])
    assert noisy["cosine_mean"] > 0.99
    constant = optimized_torchscript.agreement([np.zeros((10, 2))], [np.zeros((10, 2))])  # a dead output
    assert constant == {"cosine_mean": 1.0, "cosine_min": 1.0, "max_abs_diff": 0.0}


def test_the_int8_export_is_refused_below_the_jobs_threshold(mlp):
    load = optimized_torchscript.load
    load(mlp["dir"], mlp["manifest"], "cpu", 1, backend="onnx_int8", cache_root=mlp["cache"], say=lambda _: None)
    info = json.loads(
        (
            optimized_torchscript.optimized_cache.optimized_dir(mlp["cache"], mlp["version"].sha256, "onnx_int8", 1)
            / "info.json"
        ).read_text()
    )
    assert 0.99 < info["cosine_mean"] < 1.0 and info["max_abs_diff"] > 0  # INT8 weights move the outputs a little
    assert info["reduce_range"] is optimized_cache.int8_weights_need_reduced_range()  # 7-bit weights without VNNI
    strict = min(1.0, info["cosine_mean"] + 1e-5)
    with pytest.raises(BackendRefusedError) as refused:
        load(mlp["dir"], mlp["manifest"], "cpu", 1, backend="onnx_int8", min_cosine=strict, cache_root=mlp["cache"])
    message = str(refused.value)
    assert f"backend 'onnx_int8' refused for mlp/v1: its outputs on {info['sample_rows']} sample rows" in message
    assert f"{info['cosine_mean']:.4f}" in message and f"backend_min_cosine={strict:g}" in message
    assert "Nothing was scored" in message and "JobSpec(backend='onnx') keeps fp32 weights" in message
    assert refused.value.permanent


def test_int8_weights_keep_7_bits_on_an_x86_cpu_without_vnni():
    """Full 8-bit weights saturate ONNX Runtime's u8 x s8 products on AVX2 without VNNI (this tiny
    MLP's cosine fell to 0.9894 on an AMD EPYC, below the default guard); VNNI and AMX have no such
    limit, and neither has an ARM CPU."""
    need = optimized_cache.int8_weights_need_reduced_range
    avx2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
    assert need(avx2, "x86_64") and need(avx2, "AMD64")
    assert not need(avx2.replace("avx2", "avx2 avx512f avx512_vnni"), "x86_64")
    assert not need(avx2.replace("avx2", "avx2 avx_vnni"), "x86_64")
    assert not need(avx2.replace("avx2", "avx2 amx_int8"), "x86_64")
    assert need("", "x86_64")  # no flags to read: assume the saturating path
    assert not need(avx2, "aarch64")


def test_models_the_export_cannot_express_are_refused_with_why(tmp_path):
    import torch

    from airflow_provider_batchinfer.registry import ModelRegistry
    from airflow_provider_batchinfer.registry.fetch import fetch_version

    registry = ModelRegistry(str(tmp_path / "registry"))
    listed = registry.log_model(
        "listed",
        "v1",
        "torchscript",
        tiny_mlp(4),
        signature={"inputs": {"x": "list<float32>"}, "outputs": {"s": "float32"}},
    )

    class Named(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"s": x.sum(dim=1)}

    named = registry.log_model(
        "named",
        "v1",
        "torchscript",
        torch.jit.script(Named()),
        signature={"inputs": {"a": "float32"}, "outputs": {"s": "float32"}},
    )
    narrow = registry.log_model(  # a signature of 3 features for a model that takes 4
        "narrow",
        "v1",
        "torchscript",
        tiny_mlp(4),
        signature={"inputs": dict.fromkeys("abc", "float32"), "outputs": {"s": "float32"}},
    )
    cases = [
        (listed, r"reads the list column\(s\) \['x'\], whose width the signature does not give"),
        (narrow, r"PyTorch itself failed on 512 rows of the 3 features its signature names \(RuntimeError: "),
        (named, r"named/v1 returns dict. Run it with JobSpec\(backend=None\)"),
    ]
    for version, why in cases:
        model_dir, manifest = fetch_version(version.uri, version.sha256)
        with pytest.raises(BackendRefusedError, match=why):
            optimized_torchscript.load(
                model_dir, {**manifest, "sha256": version.sha256}, "cpu", 1, backend="onnx", cache_root=tmp_path / "c"
            )
        assert not list((tmp_path / "c" / "optimized" / version.sha256).glob("onnx-v*/model.onnx"))


# --- the runtime, in its own process ---------------------------------------------------------------------------
def _job(tmp_path: Path, mlp: dict, name: str, rows: int, **spec) -> tuple[Path, str, pa.Table]:
    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec

    data = _features(rows, seed=3).append_column("row_id", pa.array(range(rows), pa.int64()))
    inputs = tmp_path / f"in-{name}"
    inputs.mkdir()
    for n, start in enumerate(range(0, rows, rows // 2)):
        pq.write_table(data.slice(start, rows // 2), inputs / f"part-{n}.parquet")
    run_dir = tmp_path / f"out-{name}"
    run_dir.mkdir()
    job = job_file(
        run_dir,
        mlp["version"],
        mlp["registry"].root,
        [inputs],
        job_id=f"batchinfer-{name}",
        attempt=f"t01{name}",
        input_spec=InputSpec(id_column="row_id"),
        job_spec=JobSpec(**spec),
    )
    return run_dir, write_job_file(job), data


def _run_in_driver(spec: str, cache: Path) -> tuple[subprocess.CompletedProcess, bool]:
    """The runtime on ``spec`` as the embedded Ray's driver runs it; (the process, whether torch was
    imported in it)."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['runtime', '--spec', {spec!r}]\n"
        "try:\n"
        "    runpy.run_module('airflow_provider_batchinfer.runtime', run_name='__main__')\n"
        "finally:\n"
        "    print('TORCH_IMPORTED', 'torch' in sys.modules, flush=True)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "BATCHINFER_MODEL_CACHE": str(cache),
        EMBEDDED_ENV: "1",
        "RAY_ADDRESS": "127.0.0.1:9",  # nothing listens there: a job that tried Ray would fail
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return done, "TORCH_IMPORTED True" in done.stdout


def test_a_job_on_the_cached_export_never_imports_torch_and_commits_pytorchs_scores(mlp, tmp_path):
    optimized_torchscript.prepare(
        mlp["dir"] / mlp["manifest"]["options"]["file"], mlp["manifest"], "onnx", mlp["cache"]
    )
    run_dir, spec, data = _job(tmp_path, mlp, "onnx", 6000, backend="onnx")
    done, torch_imported = _run_in_driver(spec, mlp["cache"])
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "scoring 6,000 rows in the driver process" in log and "backend onnx: cached export" in log
    assert torch_imported is False, log[-3000:]  # the reason for the backend: no torch import per job
    manifest = committed_manifest(str(run_dir))
    assert manifest is not None and manifest["counts"]["output_rows"] == 6000
    out = pq.read_table([str(run_dir / f["name"]) for f in manifest["files"]]).sort_by("row_id")
    assert out["row_id"].to_pylist() == list(range(6000))
    reference = load_predictor(mlp["dir"], mlp["manifest"], "cpu", 1)(data.select(FEATURES), {})["score"]
    assert np.abs(out["score"].to_numpy() - reference).max() < 1e-5

    strict_dir, strict, _ = _job(tmp_path, mlp, "strict", 100, backend="onnx_int8", backend_min_cosine=1.0)
    refused, _ = _run_in_driver(strict, mlp["cache"])
    assert refused.returncode != 0
    last = [line for line in refused.stdout.splitlines() if line.startswith("BATCHINFER_ERROR ")][-1]
    error = json.loads(last.split(" ", 1)[1])
    assert error["type"] == "BackendRefusedError" and error["permanent"] is True
    assert "backend_min_cosine=1" in error["error"] and "Nothing was scored" in error["error"]
    assert sorted(p.name for p in strict_dir.iterdir() if p.name != "_claims") == ["_job.json"]  # no part, no _SUCCESS


@pytest.mark.parametrize("tampered", ["model.onnx", "info.json"])
def test_a_tampered_cached_export_is_detected_and_exported_again(mlp, tmp_path, capsys, tampered):
    """The cached export carries the sha256 of each of its files: a changed model (same size) or a
    guard figure edited upward is said so and exported again, never served."""
    cache, load = tmp_path / "cache", optimized_torchscript.load
    first: list[str] = []
    predict = load(mlp["dir"], mlp["manifest"], "cpu", 1, 4096, backend="onnx", cache_root=cache, say=first.append)
    directory = optimized_cache.optimized_dir(cache, mlp["version"].sha256, "onnx", optimized_torchscript.FORMAT)
    assert json.loads((directory / optimized_cache.DIGEST_FILE).read_text()).keys() == {"info.json", "model.onnx"}
    batch = _features(64)
    expected = predict(batch, {})["score"]
    path = directory / tampered
    if tampered == "info.json":  # the guard's figures rewritten (here: how many rows they were measured on)
        info = json.loads(path.read_text())
        path.write_text(json.dumps({**info, "sample_rows": info["sample_rows"] * 10}))
    else:  # one byte of the exported model flipped, same size
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    again: list[str] = []
    predict = load(mlp["dir"], mlp["manifest"], "cpu", 1, 4096, backend="onnx", cache_root=cache, say=again.append)
    out = capsys.readouterr().out
    assert f"cached export at {directory} is refused: its file {tampered} changed after it was exported" in out
    assert again[0].startswith("[batchinfer] backend onnx: exported in "), again
    assert optimized_cache.export_damage(directory) is None
    assert np.abs(predict(batch, {})["score"] - expected).max() < 1e-6


def test_an_export_without_its_digest_is_exported_again(mlp, tmp_path, capsys):
    cache, load = tmp_path / "cache", optimized_torchscript.load
    load(mlp["dir"], mlp["manifest"], "cpu", 1, 4096, backend="onnx", cache_root=cache, say=lambda _: None)
    directory = optimized_cache.optimized_dir(cache, mlp["version"].sha256, "onnx", optimized_torchscript.FORMAT)
    (directory / optimized_cache.DIGEST_FILE).unlink()  # as an export made before exports were hashed
    lines: list[str] = []
    load(mlp["dir"], mlp["manifest"], "cpu", 1, 4096, backend="onnx", cache_root=cache, say=lines.append)
    assert f"no readable {optimized_cache.DIGEST_FILE}; exporting it again" in capsys.readouterr().out
    assert "exported in" in lines[0] and optimized_cache.export_damage(directory) is None
