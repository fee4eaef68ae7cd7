"""Any ONNX model through ONNX Runtime (``onnx`` flavor).

Graph inputs are fed by name from the input columns mapped at log time (one column per width-1
input, a list column or several stacked columns for a wider one), in the dtype the graph declares.
The session is sized for the replica (``runtime/model/ort.py``: its threads, CUDA when the job asked for
GPUs and this onnxruntime build has it, CPU otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from airflow_provider_batchinfer.registry.tabular import read_settings
from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor
from airflow_provider_batchinfer.runtime.model.flavors.tabular.tabular_inputs import TRANSFER_ROWS

_NUMPY = {"string": object, "bool": np.bool_}


def _feed(inputs: Any, spec: dict[str, Any]) -> np.ndarray:
    """One graph input's tensor from its columns (or its one list column)."""
    import pyarrow as pa

    dtype = _NUMPY.get(spec["dtype"], np.dtype(spec["dtype"]))
    rows = inputs.num_rows
    if spec["columns"] is None:  # a list column: one row's list is one row of the tensor
        col = inputs.column(spec["name"]).combine_chunks()
        flat = col.flatten().to_numpy(zero_copy_only=False)
        return np.ascontiguousarray(flat.astype(dtype, copy=False).reshape(rows, -1))
    out = np.empty((rows, len(spec["columns"])), dtype=dtype)
    for i, name in enumerate(spec["columns"]):
        col = inputs.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        out[:, i] = col.to_pylist() if dtype is object else col.to_numpy()
    return out if spec["rank"] == 2 else out[:, 0]


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    from airflow_provider_batchinfer.runtime.model.ort import ort_session

    settings = read_settings(model_dir, manifest)
    path = model_dir / manifest["options"]["dir"] / settings["file"]
    session = ort_session(path, intra_op_threads=threads, use_cuda=device == "cuda")
    outputs = list(manifest["signature"]["outputs"])
    specs = settings["inputs"]

    def score(feeds: dict[str, np.ndarray]) -> dict[str, Any]:
        values = session.run(outputs, feeds)
        return {
            name: v[:, 0] if v.ndim == 2 and v.shape[1] == 1 else v for name, v in zip(outputs, values, strict=True)
        }

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        feeds = {spec["name"]: _feed(inputs, spec) for spec in specs}
        rows, step = inputs.num_rows, max_rows or inputs.num_rows or 1
        if rows <= step:
            return score(feeds)
        parts = [score({k: v[a : a + step] for k, v in feeds.items()}) for a in range(0, rows, step)]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    return predict


FLAVOR = Flavor(name="onnx", load=load, transfer_rows=TRANSFER_ROWS)
