"""TorchScript models over tabular features.

The signature's input columns, in order, become the feature matrix: several numeric columns are
stacked side by side; a single list/tensor column is used as the matrix itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor


def features(inputs) -> np.ndarray:
    """The float32 feature matrix of a batch (also what the ONNX backend feeds, ``optimized_torchscript.py``)."""
    import pyarrow as pa

    first = inputs.schema.field(0).type
    if inputs.num_columns == 1 and (
        pa.types.is_list(first) or pa.types.is_large_list(first) or pa.types.is_fixed_size_list(first)
    ):
        col = inputs.column(0).combine_chunks()
        width = col.type.list_size if pa.types.is_fixed_size_list(col.type) else None
        flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        return flat.reshape(len(col), width or -1)
    cols = float32_columns(inputs)
    return np.column_stack(cols) if len(cols) > 1 else cols[0].reshape(-1, 1)


def float32_columns(inputs) -> list[np.ndarray]:
    """Each column of the batch as a float32 vector (no copy where it already is one)."""
    return [inputs.column(i).to_numpy().astype(np.float32, copy=False) for i in range(inputs.num_columns)]


def feature_tensor(inputs, device: str, transpose_there: bool | None = None):
    """The batch's feature matrix as a contiguous float32 tensor on ``device``.

    Off the CPU (``transpose_there`` defaults to ``device != "cpu"``), several numeric columns are
    stacked as they are stored, one contiguous row per column, copied over, and transposed on the
    device. Why: ``np.column_stack`` writes the matrix one value at a time across 64 columns, and
    that was the replica's largest cost per batch on an H200 (35.7 of 41.8 ms for 65,536 x 64:
    ``benchmarks/gpu_bench.py``'s MLP batch profile), while stacking whole columns is a few memcpys
    and a transpose on the GPU a few microseconds. On the CPU the transpose would be the same
    strided copy, so the CPU path is ``features`` unchanged."""
    import pyarrow as pa
    import torch

    if transpose_there is None:
        transpose_there = device != "cpu"
    several_numeric = inputs.num_columns > 1 and all(
        pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_boolean(f.type)
        for f in inputs.schema
    )
    if not (transpose_there and several_numeric):
        return torch.from_numpy(np.ascontiguousarray(features(inputs))).to(device)
    return torch.from_numpy(np.stack(float32_columns(inputs))).to(device).T.contiguous()


# tabular rows are small: hand a replica large batches and convert them to one matrix at once
TRANSFER_ROWS = 65536
# ...and on CPU, unless the job sets JobSpec.max_batch_rows, score them in calls of 4,096 rows
# (``flavors.call_rows``): a call has a fixed cost that 256-row calls (``Tuning.call_rows``, sized
# for text) pay 16 times as often, and a whole 65,536-row batch spills each layer's activations out
# of the CPU caches (benchmark MLP, 2 threads, 1M rows: 2.26 s in whole batches, 1.34 s at 16,384
# rows, 0.97 s at 4,096 and 1,024)
CPU_CALL_ROWS = 4096


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    import torch

    if device == "cpu":
        torch.set_num_threads(max(1, threads))
    model = torch.jit.load(str(model_dir / manifest["options"]["file"]), map_location=device)
    model.eval()
    outputs = list(manifest["signature"]["outputs"])

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        x = feature_tensor(inputs, device)
        step = max_rows or len(x) or 1
        with torch.inference_mode():
            if len(x) <= step:
                y = model(x)
            else:  # model calls of at most max_rows rows (flavors.call_rows)
                y = _concat([model(x[i : i + step]) for i in range(0, len(x), step)])
        if isinstance(y, dict):
            return {name: _to_numpy(y[name]) for name in outputs}
        if isinstance(y, (tuple, list)):
            return name_outputs([_to_numpy(t) for t in y], outputs)
        return name_outputs(_to_numpy(y), outputs)

    return predict


def name_outputs(y: np.ndarray | list[np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    """The signature's output columns from what the model returned: one array per output (a
    tuple), or one array whose columns are the outputs (a single output may be a flat vector)."""
    if isinstance(y, list):
        if len(y) != len(outputs):
            raise ValueError(f"model returned {len(y)} outputs but its signature names {outputs}")
        return dict(zip(outputs, y, strict=True))
    if len(outputs) == 1:
        return {outputs[0]: y}
    if y.ndim != 2 or y.shape[1] != len(outputs):
        raise ValueError(f"model returned shape {y.shape} but its signature names {len(outputs)} outputs")
    return {name: y[:, i] for i, name in enumerate(outputs)}


def _concat(parts: list[Any]) -> Any:
    import torch

    first = parts[0]
    if isinstance(first, dict):
        return {k: torch.cat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(torch.cat([p[i] for p in parts]) for i in range(len(first)))
    return torch.cat(parts)


def _to_numpy(t) -> np.ndarray:
    return squeeze_column(t.detach().to("cpu").numpy())


def squeeze_column(arr: np.ndarray) -> np.ndarray:
    """An ``(n, 1)`` output as a flat column of ``n`` values."""
    return arr[:, 0] if arr.ndim == 2 and arr.shape[1] == 1 else arr


FLAVOR = Flavor(
    name="torchscript",
    load=load,
    transfer_rows=TRANSFER_ROWS,
    cpu_call_rows=CPU_CALL_ROWS,
    optimized="airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_torchscript",
)
