"""The optimized backend for TorchScript models over tabular features: ONNX Runtime, fp32 or INT8.

Why: a small tabular network (an MLP scoring millions of rows) spends a large share of a job on
PyTorch itself: ``import torch`` takes ~1-2 s of a job that scores a million rows in ~2 s, and
every job pays it again, since each runs in a fresh process. Exported once to ONNX, the same network
runs in ONNX Runtime, which imports in ~0.1 s and scored the benchmark's MLP ~1.5x as fast as
PyTorch on two threads (1M rows in 4,096-row calls: 0.56 s against 0.85-2.0 s).

Chosen per job with ``JobSpec(backend="onnx" | "onnx_int8")``, as for sentence-transformers
models (``optimized_text.py``); both share the cache and the guard (``optimized_cache.py``). The
export happens on the first job's replica that needs it, once per model version and node.

The accuracy guard: at export time both PyTorch and ONNX Runtime score a fixed sample of
``SAMPLE_ROWS`` seeded standard-normal feature rows, and each output column of the two is compared
by its cosine similarity after subtracting the column's mean (the Pearson correlation: a
probability near 0.5 everywhere would otherwise agree at ~1.0 however its ranking changed). The
mean and least of those figures, and the largest absolute difference, are stored with the export;
a job whose ``JobSpec.backend_min_cosine`` is above the mean is refused before any row is scored.

Supported: models whose signature reads one numeric column per feature (the width of the feature
matrix is then known when the model is exported) and that return a tensor or a tuple of tensors.
A model over one list column, one returning a dict, or one using an operator the exporter lacks
is refused with a message naming why.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from airflow_provider_batchinfer.runtime.model.flavors.optimized import optimized_cache
from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_cache import (
    BackendRefusedError,
    check_guard,
    has_files,
)
from airflow_provider_batchinfer.runtime.model.flavors.protocol import OptimizedBackend
from airflow_provider_batchinfer.runtime.model.flavors.torchscript import features, name_outputs, squeeze_column
from airflow_provider_batchinfer.store.redact import clip

FORMAT = 1
SAMPLE_ROWS = 512  # feature rows in the accuracy sample: milliseconds for a tabular model, once
INPUT_NAME = "features"
LIST_TYPES = ("list", "large_list", "fixed_size_list")


def feature_width(manifest: dict[str, Any]) -> int:
    """The columns of the feature matrix: one per signature input, each a number."""
    inputs: dict[str, str] = dict(manifest["signature"]["inputs"])
    lists = [name for name, dtype in inputs.items() if dtype.split("<")[0].strip() in LIST_TYPES]
    if lists:
        raise BackendRefusedError(
            f"the optimized backend exports a torchscript model that reads one numeric column per feature; "
            f"{manifest['name']}/{manifest['version']} reads the list column(s) {lists}, whose width the "
            "signature does not give. Run it with JobSpec(backend=None) (PyTorch)"
        )
    return len(inputs)


def _as_arrays(y: Any, model: str) -> list[np.ndarray]:
    """What the model returned, as one array per output; a dict (or anything else) is refused."""
    import torch

    if isinstance(y, torch.Tensor):
        return [y.detach().numpy()]
    if isinstance(y, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in y):
        return [t.detach().numpy() for t in y]
    raise BackendRefusedError(
        f"the optimized backend exports torchscript models that return a tensor or a tuple of tensors; "
        f"{model} returns {type(y).__name__}. Run it with JobSpec(backend=None) (PyTorch)"
    )


def agreement(reference: list[np.ndarray], mine: list[np.ndarray]) -> dict[str, float]:
    """The guard's figures: per output column, the cosine of the mean-centred values over the
    sample (mean and least over the columns), and the largest absolute difference anywhere."""
    columns = [a.reshape(len(a), -1) for a in reference], [b.reshape(len(b), -1) for b in mine]
    ref = np.concatenate(columns[0], axis=1).astype(np.float64)
    got = np.concatenate(columns[1], axis=1).astype(np.float64)
    cosine = optimized_cache.cosines((ref - ref.mean(axis=0)).T, (got - got.mean(axis=0)).T)
    return {
        "cosine_mean": round(float(cosine.mean()), 6),
        "cosine_min": round(float(cosine.min()), 6),
        "max_abs_diff": float(np.abs(ref - got).max(initial=0.0)),
    }


def export(model_file: Path, manifest: dict[str, Any], backend: str, target: Path) -> dict[str, Any]:
    """Export the model to ``target`` for ``backend`` and measure it against PyTorch on the sample."""
    import torch

    from airflow_provider_batchinfer.runtime.model.ort import ort_session

    model = f"{manifest['name']}/{manifest['version']}"
    started = time.monotonic()
    sample = np.random.default_rng(18).standard_normal((SAMPLE_ROWS, feature_width(manifest)), dtype=np.float32)
    try:  # the reference first: exporting a ScriptModule leaves it unfit for inference
        with torch.no_grad():
            returned = torch.jit.load(str(model_file), map_location="cpu").eval()(torch.from_numpy(sample))
    except Exception as exc:  # e.g. the signature names more or fewer features than the model takes
        raise BackendRefusedError(
            f"the optimized backend could not export {model}: PyTorch itself failed on {SAMPLE_ROWS} rows of the "
            f"{sample.shape[1]} features its signature names ({type(exc).__name__}: {clip(str(exc).strip(), 300)}). "
            "Log the model with a signature naming one input column per feature, in order"
        ) from exc
    reference = _as_arrays(returned, model)
    names = [f"output_{i}" for i in range(len(reference))]
    fp32 = target / ("model.onnx" if backend == "onnx" else "model-fp32.onnx")
    try:
        with warnings.catch_warnings():  # a ScriptModule has no Python signature: the exporter says so, harmlessly
            warnings.filterwarnings("ignore", message="no signature found", category=UserWarning)
            torch.onnx.export(
                torch.jit.load(str(model_file), map_location="cpu").eval(),
                (torch.from_numpy(sample[:2]),),
                str(fp32),
                input_names=[INPUT_NAME],
                output_names=names,
                dynamic_axes={INPUT_NAME: {0: "rows"}} | {name: {0: "rows"} for name in names},
                opset_version=17,
                dynamo=False,  # the TorchScript exporter: the only one that takes a ScriptModule
            )
    except Exception as exc:  # an operator ONNX lacks, a data-dependent shape: PyTorch still serves it
        raise BackendRefusedError(
            f"the optimized backend could not export {model} to ONNX ({type(exc).__name__}: {exc}). "
            "Run it with JobSpec(backend=None) (PyTorch)"
        ) from exc
    reduced = optimized_cache.quantize_int8(fp32, target / "model.onnx") if backend == "onnx_int8" else False
    mine = ort_session(target / "model.onnx", intra_op_threads=1).run(names, {INPUT_NAME: sample})
    return {
        "format": FORMAT,
        "backend": backend,
        "outputs": len(names),
        "tupled": not isinstance(returned, torch.Tensor),
        "width": int(sample.shape[1]),
        "reduce_range": reduced,
        **agreement(reference, [np.asarray(m) for m in mine]),
        "sample_rows": SAMPLE_ROWS,
        "export_s": round(time.monotonic() - started, 2),
    }


def prepare(
    model_file: Path, manifest: dict[str, Any], backend: str, cache_root: Path
) -> tuple[Path, dict[str, Any], bool]:
    """The cached export of this model version (``manifest["sha256"]``) for ``backend``, made now
    when missing: (its directory, its ``info.json``, whether this call exported it)."""
    return optimized_cache.prepare(
        optimized_cache.optimized_dir(cache_root, manifest["sha256"], backend, FORMAT),
        lambda work: export(model_file, manifest, backend, work),
        lambda target: has_files(target, "model.onnx"),
    )


def load(
    model_dir: Path,
    manifest: dict[str, Any],
    device: str,
    threads: int,
    max_rows: int | None = None,
    *,
    backend: str,
    min_cosine: float = 0.99,
    cache_root: Path,
    say: Callable[[str], None] = print,
) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """A predictor with the torchscript flavor's shape, running on ONNX Runtime (no torch once the
    export is cached)."""
    from airflow_provider_batchinfer.runtime.model.ort import ort_session

    model = f"{manifest['name']}/{manifest['version']}"
    feature_width(manifest)  # refused before anything is exported
    directory, info, exported = prepare(model_dir / manifest["options"]["file"], manifest, backend, cache_root)
    check_guard(info, min_cosine, model, f"outputs on {info['sample_rows']} sample rows (centred)")
    say(
        f"[batchinfer] backend {backend}: {'exported in ' + str(info['export_s']) + 's' if exported else 'cached export'} "
        f"at {directory}; accuracy guard: mean cosine {info['cosine_mean']:.4f} (least {info['cosine_min']:.4f}, "
        f"largest difference {info['max_abs_diff']:.2g}) >= {min_cosine:g}"
    )
    session = ort_session(directory / "model.onnx", intra_op_threads=threads, use_cuda=device == "cuda")
    names = [f"output_{i}" for i in range(int(info["outputs"]))]
    outputs = list(manifest["signature"]["outputs"])

    def predict(inputs: Any, params: dict[str, Any]) -> dict[str, Any]:
        x = np.ascontiguousarray(features(inputs), dtype=np.float32)
        step = max_rows or len(x) or 1
        calls = [session.run(names, {INPUT_NAME: x[i : i + step]}) for i in range(0, len(x), step)] or [
            session.run(names, {INPUT_NAME: x})
        ]
        arrays = [squeeze_column(np.concatenate([call[k] for call in calls])) for k in range(len(names))]
        return name_outputs(arrays if info["tupled"] else arrays[0], outputs)

    return predict


BACKEND = OptimizedBackend(flavor="torchscript", load=load)
