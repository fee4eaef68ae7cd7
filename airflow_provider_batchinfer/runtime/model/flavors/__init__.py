"""One small adapter per model kind, all with the same shape, found here by name.

Each flavor module declares ``FLAVOR = Flavor(...)`` (``flavors/protocol.py``): its ``load`` and
the capabilities the runtime reads, as typed fields.

``load(model_dir, manifest, device, threads, max_rows) -> predictor`` and ``predictor(inputs,
params) -> {output column: values}``, where ``inputs`` is a ``pyarrow.Table`` holding exactly the
model's input columns (signature names, signature order). Each flavor converts only what it needs,
so text stays Python strings for a tokenizer and numbers go to numpy without a pandas detour.

``max_rows`` bounds the rows of one model call: ``JobSpec.max_batch_rows`` when the job sets it,
else the kind's own size (:func:`call_rows`), resolved once by the driver. The batches Ray hands
a replica may be larger (``transfer_rows``): moving and converting few large batches is cheaper
than many small ones, and a text model sorts a larger batch by length before cutting it into
model calls, so it pads less. A flavor whose ``transfer_rows`` is 0 gets batches of exactly
``max_rows`` (the user's own ``predict`` never sees more than that).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor, OptimizedBackend, Predictor
from airflow_provider_batchinfer.runtime.tuning import TUNING

__all__ = [
    "Flavor",
    "OptimizedBackend",
    "Predictor",
    "adapter_module",
    "call_rows",
    "flavor",
    "is_optimized",
    "load_optimized",
    "load_predictor",
    "names",
    "optimized_backend",
    "optimized_flavors",
    "refuse_backend",
    "transfer_rows",
]

# name -> the module declaring its ``FLAVOR``: a path, imported on first use, so a job imports
# only its own flavor's module (and that module imports its model library only in ``load``)
_MODULES = {
    "torchscript": "airflow_provider_batchinfer.runtime.model.flavors.torchscript",
    "sentence_transformers": "airflow_provider_batchinfer.runtime.model.flavors.sentence_transformers",
    "python": "airflow_provider_batchinfer.runtime.model.flavors.python_class",
    "text_generation": "airflow_provider_batchinfer.runtime.model.flavors.text_generation",
    "image_classification": "airflow_provider_batchinfer.runtime.model.flavors.image_classification",
    # traditional models
    "sklearn": "airflow_provider_batchinfer.runtime.model.flavors.tabular.scikit_learn",
    "xgboost": "airflow_provider_batchinfer.runtime.model.flavors.tabular.xgboost_booster",
    "lightgbm": "airflow_provider_batchinfer.runtime.model.flavors.tabular.lightgbm_booster",
    "onnx": "airflow_provider_batchinfer.runtime.model.flavors.tabular.onnx_model",
    # Hugging Face pipelines and MLflow models
    "transformers_pipeline": "airflow_provider_batchinfer.runtime.model.flavors.transformers_pipeline",
    "mlflow_pyfunc": "airflow_provider_batchinfer.runtime.model.flavors.mlflow_pyfunc",
}


def names() -> tuple[str, ...]:
    """The flavors this runtime knows, without importing any of them."""
    return tuple(_MODULES)


def adapter_module(flavor: str) -> str | None:
    """The module that adapts ``flavor`` (None for a flavor this runtime does not know): a warm
    spare imports it ahead of the job."""
    return _MODULES.get(flavor)


def flavor(name: str) -> Flavor:
    """``name``'s capabilities: its module's ``FLAVOR``, the module imported now if it was not yet.
    A module that declares no ``Flavor`` under that name is a bug in this package, refused here."""
    if name not in _MODULES:
        raise ValueError(f"model flavor {name!r} is not supported by this runtime ({', '.join(_MODULES)})")
    declared = getattr(importlib.import_module(_MODULES[name]), "FLAVOR", None)
    if not isinstance(declared, Flavor) or declared.name != name:
        raise TypeError(f"{_MODULES[name]} must declare FLAVOR = Flavor(name={name!r}, ...), got {declared!r}")
    return declared


def optimized_backend(name: str) -> OptimizedBackend | None:
    """The ONNX Runtime backend of flavor ``name``, its module imported now (None: it has none)."""
    module = flavor(name).optimized
    if module is None:
        return None
    declared = getattr(importlib.import_module(module), "BACKEND", None)
    if not isinstance(declared, OptimizedBackend) or declared.flavor != name:
        raise TypeError(f"{module} must declare BACKEND = OptimizedBackend(flavor={name!r}, ...), got {declared!r}")
    return declared


def optimized_flavors() -> tuple[str, ...]:
    """The flavors with an ONNX Runtime backend, for a refusal's message: imports every flavor
    module (none imports a model library), so only an error path asks."""
    return tuple(sorted(name for name in _MODULES if flavor(name).optimized is not None))


def is_optimized(backend: str | None) -> bool:
    """Whether ``JobSpec.backend`` names an optimized (ONNX Runtime) backend: None and "torch" are
    the flavor's own."""
    return backend not in (None, "torch")


def load_predictor(
    model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None
) -> Predictor:
    """The predictor of the manifest's flavor, on the flavor's own library."""
    return flavor(manifest["flavor"]).load(model_dir, manifest, device=device, threads=threads, max_rows=max_rows)


def refuse_backend(backend: str, name: str, model: str) -> None:
    """Refuse ``backend`` for flavor ``name`` (of ``model``, "name/version") when the flavor has no
    ONNX Runtime backend; the driver asks before Ray starts, a replica again before it loads."""
    if name in _MODULES and flavor(name).optimized is not None:
        return
    from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_cache import BackendRefusedError

    raise BackendRefusedError(
        f"JobSpec.backend={backend!r} applies to {' and '.join(optimized_flavors())} models; "
        f"{model} is {name!r}. Leave JobSpec.backend unset for it"
    )


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
    refused."""
    name = manifest["flavor"]
    refuse_backend(backend, name, f"{manifest['name']}/{manifest['version']}")
    optimized = optimized_backend(name)
    assert optimized is not None  # refuse_backend raised otherwise
    return optimized.load(
        model_dir,
        manifest,
        device,
        threads,
        max_rows,
        backend=backend,
        min_cosine=min_cosine,
        cache_root=cache_root,
    )


def call_rows(name: str, device: str, max_batch_rows: int | None, params: Mapping[str, Any] | None = None) -> int:
    """Rows per model call of flavor ``name`` on ``device`` ("cpu", or a GPU such as "cuda"): the
    job's ``JobSpec.max_batch_rows`` exactly when it sets one; else, on CPU, the kind's own
    ``cpu_call_rows`` where it declares one (a small model's call pays a fixed cost that larger calls
    share; a text encoder's own default), else ``TUNING.call_rows`` (sized for text and GPU memory).
    A model parameter the kind reads as its own rows per call (``call_rows_param``, in ``params``)
    comes before the kind's defaults. The one place this is decided: the driver, the replica and
    the vLLM engine all ask here."""
    if max_batch_rows is not None:
        return int(max_batch_rows)
    declared = flavor(name)
    if declared.call_rows_param and params and params.get(declared.call_rows_param) is not None:
        return max(1, int(params[declared.call_rows_param]))
    cpu_rows = declared.cpu_call_rows if device == "cpu" else None
    return cpu_rows or TUNING.call_rows


def transfer_rows(name: str, max_rows: int, row_bytes: float, gpu: bool = False) -> int:
    """Rows per batch Ray hands a replica: the flavor's preferred size (``gpu_transfer_rows`` on a
    GPU where it names one), never below ``max_rows`` (the job's rows per model call), and at most
    ``TUNING.transfer_bytes`` of input (``row_bytes``: uncompressed bytes per input row)."""
    declared = flavor(name)
    preferred = declared.transfer_rows
    if gpu and declared.gpu_transfer_rows is not None:
        preferred = declared.gpu_transfer_rows
    if preferred <= max_rows:
        return max_rows
    by_bytes = int(TUNING.transfer_bytes // max(row_bytes, 1.0))
    return max(max_rows, min(preferred, by_bytes))
