"""Feature matrices for the traditional-model flavors (sklearn, xgboost, lightgbm, onnx).

Numeric features go straight from Arrow to one float64 numpy matrix (no pandas detour), nulls as
NaN, so tree libraries treat them as missing the way they do in ``fit``. Categorical features need
the library's own pandas path (XGBoost and LightGBM map category *names* to the codes they were
trained with), so a model with any categorical feature gets a DataFrame with category columns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# tabular rows are small: hand a replica large batches and convert them to one matrix at once
TRANSFER_ROWS = 65536
# ...and on CPU, unless the job sets JobSpec.max_batch_rows, call the library with this many rows
# (``flavors.call_rows``) instead of ``Tuning.call_rows`` (256, sized for text and GPU memory): each
# predict call pays a fixed cost (input validation, thread start-up) that small calls pay over and
# over. Measured over 1M rows x 32 features, 2 threads: XGBoost (200 trees, depth 8) 2.63 s in
# 256-row calls, 1.48 s at 4,096, 1.42 s at 16,384, 1.67 s at 65,536; scikit-learn
# HistGradientBoosting 5.0 s, 3.0 s, 2.2 s, 2.7 s.
CPU_CALL_ROWS = 16384


def matrix(inputs: Any, dtype: Any = np.float64) -> np.ndarray:
    """The input columns (signature order) as one C-contiguous ``(rows, features)`` matrix; nulls
    are NaN, booleans 0 and 1. Columns without nulls are read without a copy before the one into
    the matrix."""
    out = np.empty((inputs.num_rows, inputs.num_columns), dtype=dtype)
    for i in range(inputs.num_columns):
        out[:, i] = inputs.column(i).to_numpy(zero_copy_only=False)
    return out


def frame(inputs: Any, categorical: list[str]) -> Any:
    """The input columns as a DataFrame, ``categorical`` ones as pandas categories (from Arrow
    dictionaries or plain strings/ints), the rest numeric with NaN for nulls."""
    import pandas as pd

    df = inputs.to_pandas()
    for name in categorical:
        if not isinstance(df[name].dtype, pd.CategoricalDtype):
            df[name] = df[name].astype("category")
    return df


def chunked(score: Callable[[Any], dict[str, Any]], x: Any, rows: int, max_rows: int | None) -> dict[str, Any]:
    """``score`` over model calls of at most ``max_rows`` rows (``flavors.call_rows``), joined."""
    step = max_rows or rows or 1
    if rows <= step:
        return score(x)
    parts = [score(row_slice(x, a, min(a + step, rows))) for a in range(0, rows, step)]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def row_slice(x: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a numpy matrix, a DataFrame or an Arrow table, without a copy."""
    if hasattr(x, "iloc"):
        return x.iloc[start:stop]
    if hasattr(x, "num_rows"):
        return x.slice(start, stop - start)
    return x[start:stop]


def ordered(inputs: Any, settings: dict[str, Any]) -> Any:
    """The input columns in the model's feature order (``flavor.json``): the signature in MODEL.json
    and the job file is a JSON object written with sorted keys, so its order is not the model's."""
    features = settings["features"]
    return inputs if inputs.column_names == features else inputs.select(features)


def proba_outputs(proba: np.ndarray, outputs: list[str], proba_format: str) -> dict[str, Any]:
    """``predict_proba``'s matrix as the signature's columns (``outputs``: the output names in
    class order, from ``flavor.json``): one per class, or one list column."""
    if proba_format == "list":
        return {"probabilities": np.ascontiguousarray(proba, dtype=np.float64)}
    names = [o for o in outputs if o.startswith("proba_")]
    if proba.shape[1] != len(names):
        raise ValueError(f"predict_proba returned {proba.shape[1]} classes, the signature names {len(names)}")
    return {name: np.ascontiguousarray(proba[:, i]) for i, name in enumerate(names)}
