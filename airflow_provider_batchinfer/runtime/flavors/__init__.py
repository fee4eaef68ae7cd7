"""One small adapter per model kind, all with the same shape.

``load(model_dir, manifest, device, threads) -> predictor`` and ``predictor(inputs, params) ->
{output column: values}``, where ``inputs`` is a ``pyarrow.Table`` holding exactly the model's
input columns (signature names, signature order). Each flavor converts only what it needs, so
text stays Python strings for a tokenizer and numbers go to numpy without a pandas detour.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

Predictor = Callable[[Any, dict[str, Any]], dict[str, Any]]

_MODULES = {
    "torchscript": "airflow_provider_batchinfer.runtime.flavors.torchscript",
    "sentence_transformers": "airflow_provider_batchinfer.runtime.flavors.sentence_transformers",
    "python": "airflow_provider_batchinfer.runtime.flavors.python_class",
}


def load_predictor(model_dir: Path, manifest: dict[str, Any], device: str, threads: int) -> Predictor:
    flavor = manifest["flavor"]
    if flavor not in _MODULES:
        raise ValueError(f"model flavor {flavor!r} is not supported by this runtime ({', '.join(_MODULES)})")
    module = importlib.import_module(_MODULES[flavor])
    return module.load(model_dir, manifest, device=device, threads=threads)
