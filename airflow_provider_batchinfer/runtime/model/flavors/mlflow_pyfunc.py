"""Any MLflow model, through ``mlflow.pyfunc.load_model`` on the registry's hashed copy.

The copy was logged with ``trust_pickle=True`` (``registry/mlflow_import.py``): pyfunc loaders may
unpickle, so this flavor says so in the job log and lets MLflow deserialize only then. ``predict``
gets a pandas DataFrame of the signature's input columns, in signature order; what it returns (a
DataFrame, a Series, an array, a list or a dict) becomes the signature's output columns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor


def _columns(out: Any, names: list[str], model: str) -> dict[str, Any]:
    import numpy as np

    if hasattr(out, "columns") and hasattr(out, "to_numpy"):  # a DataFrame
        cols = [str(c) for c in out.columns]
        if set(names) <= set(cols):
            return {n: out[n].to_numpy() for n in names}
        if len(cols) == len(names):  # unnamed outputs (0, 1, ...): by position
            return {n: out[c].to_numpy() for n, c in zip(names, out.columns, strict=True)}
        raise ValueError(f"model {model} returned columns {cols}; its signature's outputs are {names}")
    if isinstance(out, dict):
        missing = [n for n in names if n not in out]
        if missing:
            raise ValueError(f"model {model} returned {sorted(out)}; its signature's outputs are {names}")
        return {n: out[n] for n in names}
    values = out.to_numpy() if hasattr(out, "to_numpy") else np.asarray(out) if not isinstance(out, list) else out
    if len(names) == 1:
        return {names[0]: values}
    if isinstance(values, np.ndarray) and values.ndim == 2 and values.shape[1] == len(names):
        return {n: values[:, i] for i, n in enumerate(names)}
    raise ValueError(f"model {model} returned one array for a signature with outputs {names}")


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    options = manifest["options"]
    model = f"{manifest['name']}/{manifest['version']}"
    if not options.get("trust_pickle"):
        raise ValueError(f"model {model}: an mlflow_pyfunc version must be logged with trust_pickle=True")
    origin = manifest.get("mlflow", {})
    print(
        f"[batchinfer] model {model}: MLflow model {origin.get('resolved_uri') or origin.get('uri')} loaded with "
        "trust_pickle=True (recorded when it was logged): its loader may unpickle files of the model",
        flush=True,
    )
    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "true"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow.pyfunc

    pyfunc = mlflow.pyfunc.load_model(str(model_dir / options["dir"]))
    inputs_sig = list(manifest["signature"]["inputs"])
    outputs = list(manifest["signature"]["outputs"])

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        frame = inputs.to_pandas()
        if inputs_sig:
            frame = frame[inputs_sig]
        out = pyfunc.predict(frame, params=params) if params else pyfunc.predict(frame)
        return _columns(out, outputs, model)

    return predict


# transfer_rows 0: the model's own predict sees at most JobSpec.max_batch_rows rows (unset: Tuning.call_rows)
FLAVOR = Flavor(name="mlflow_pyfunc", load=load, transfer_rows=0)
