"""One small adapter per model kind, all with the same shape.

``load(model_dir, manifest, device, threads, max_rows) -> predictor`` and ``predictor(inputs,
params) -> {output column: values}``, where ``inputs`` is a ``pyarrow.Table`` holding exactly the
model's input columns (signature names, signature order). Each flavor converts only what it needs,
so text stays Python strings for a tokenizer and numbers go to numpy without a pandas detour.

``max_rows`` (``JobSpec.max_batch_rows``) bounds the rows of one model call. The batches Ray hands
a replica may be larger (``transfer_rows``): moving and converting few large batches is cheaper
than many small ones, and a text model sorts a larger batch by length before cutting it into
model calls, so it pads less. A flavor whose ``TRANSFER_ROWS`` is 0 gets batches of exactly
``max_rows`` (the user's own ``predict`` never sees more than that).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

Predictor = Callable[[Any, dict[str, Any]], dict[str, Any]]

_MODULES = {
    "torchscript": "airflow_provider_batchinfer.runtime.flavors.torchscript",
    "sentence_transformers": "airflow_provider_batchinfer.runtime.flavors.sentence_transformers",
    "python": "airflow_provider_batchinfer.runtime.flavors.python_class",
    "text_generation": "airflow_provider_batchinfer.runtime.flavors.text_generation",
    "image_classification": "airflow_provider_batchinfer.runtime.flavors.image_classification",
    # traditional models
    "sklearn": "airflow_provider_batchinfer.runtime.flavors.scikit_learn",
    "xgboost": "airflow_provider_batchinfer.runtime.flavors.xgboost_booster",
    "lightgbm": "airflow_provider_batchinfer.runtime.flavors.lightgbm_booster",
    "onnx": "airflow_provider_batchinfer.runtime.flavors.onnx_model",
    # Hugging Face pipelines and MLflow models
    "transformers_pipeline": "airflow_provider_batchinfer.runtime.flavors.transformers_pipeline",
    "mlflow_pyfunc": "airflow_provider_batchinfer.runtime.flavors.mlflow_pyfunc",
}


# the flavors with an optimized backend (JobSpec.backend="onnx" | "onnx_int8"): ONNX Runtime,
# exported once per model version and node (optimized_cache.py)
_OPTIMIZED = {
    "sentence_transformers": "airflow_provider_batchinfer.runtime.flavors.optimized_text",
    "torchscript": "airflow_provider_batchinfer.runtime.flavors.optimized_torchscript",
}
OPTIMIZED_FLAVORS = tuple(_OPTIMIZED)


def adapter_module(flavor: str) -> str | None:
    """The module that adapts ``flavor`` (None for a flavor this runtime does not know)."""
    return _MODULES.get(flavor)


def _module(flavor: str):
    if flavor not in _MODULES:
        raise ValueError(f"model flavor {flavor!r} is not supported by this runtime ({', '.join(_MODULES)})")
    return importlib.import_module(_MODULES[flavor])


def is_optimized(backend: str | None) -> bool:
    """Whether ``JobSpec.backend`` names an optimized (ONNX Runtime) backend: None and "torch" are
    the flavor's own."""
    return backend not in (None, "torch")


def concurrent_calls(flavor: str, backend: str | None = None) -> bool:
    """Whether ``flavor``'s predictor (on ``backend``, when one is named) may be called from several
    threads at once (its module's ``CONCURRENT_CALLS``): the driver then loads it with one thread and
    calls it from as many threads as the job has (``runtime/in_driver.py``)."""
    if is_optimized(backend):
        module = importlib.import_module(_OPTIMIZED[flavor]) if flavor in _OPTIMIZED else None
    else:
        module = _module(flavor)
    return bool(getattr(module, "CONCURRENT_CALLS", False))


def load_predictor(
    model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None
) -> Predictor:
    return _module(manifest["flavor"]).load(model_dir, manifest, device=device, threads=threads, max_rows=max_rows)


def load_optimized(
    model_dir: Path,
    manifest: dict[str, Any],
    device: str,
    threads: int,
    max_rows: int | None,
    *,
    backend: str,
    min_cosine: float,
    cache_root: Path,
) -> Predictor:
    """The flavor's predictor on its optimized backend (ONNX Runtime); a flavor without one is
    refused (``check_backend`` in the driver refuses it earlier, before Ray starts)."""
    from airflow_provider_batchinfer.runtime.flavors.optimized_cache import BackendRefusedError

    flavor = manifest["flavor"]
    if flavor not in _OPTIMIZED:
        raise BackendRefusedError(
            f"JobSpec.backend={backend!r} applies to {' and '.join(OPTIMIZED_FLAVORS)} models; "
            f"{manifest['name']}/{manifest['version']} is {flavor!r}. Leave JobSpec.backend unset for it"
        )
    return importlib.import_module(_OPTIMIZED[flavor]).load(
        model_dir,
        manifest,
        device,
        threads,
        max_rows,
        backend=backend,
        min_cosine=min_cosine,
        cache_root=cache_root,
    )


def preflight(model_dir: Path | None, manifest: dict[str, Any]) -> list[str]:
    """The flavor's own checks before Ray starts (``model_dir``: a verified local copy, or None
    when the model lives in an object store and only the replicas fetch it): e.g. types a skops
    file holds that nobody trusted. Returns lines for the job log (a trusted pickle says so)."""
    check = getattr(_module(manifest["flavor"]), "preflight", None)
    return check(model_dir, manifest) if check is not None else []


def allows_missing(flavor: str) -> bool:
    """Whether null/NaN inputs reach the model (tree libraries treat them as missing values)
    instead of failing the batch before the model sees it."""
    return bool(getattr(_module(flavor), "ALLOWS_MISSING", False))


# bytes of input per batch handed to a replica, at most: bounds a replica's memory per batch
TRANSFER_BYTES = 32 << 20


def transfer_rows(flavor: str, max_rows: int, row_bytes: float, gpu: bool = False) -> int:
    """Rows per batch Ray hands a replica: the flavor's preferred size (``GPU_TRANSFER_ROWS`` on a
    GPU where it names one: larger model calls want a larger sort window), never below
    ``max_rows``, and at most ``TRANSFER_BYTES`` of input (``row_bytes``: uncompressed bytes per
    input row)."""
    module = _module(flavor)
    preferred = getattr(module, "TRANSFER_ROWS", 0)
    if gpu:
        preferred = getattr(module, "GPU_TRANSFER_ROWS", preferred)
    if preferred <= max_rows:
        return max_rows
    by_bytes = int(TRANSFER_BYTES // max(row_bytes, 1.0))
    return max(max_rows, min(preferred, by_bytes))
