"""LightGBM models in LightGBM's text format (``lightgbm`` flavor), never a pickle.

``Booster.predict`` on a float64 matrix (or, with categorical features, a DataFrame: LightGBM maps
category names to its training codes through the ``pandas_categorical`` the text model holds), with
the replica's ``num_threads``. A model logged from ``LGBMClassifier`` keeps its ``classes_`` in
``flavor.json`` (the text file has none), and ``prediction`` is computed as the classifier's own
``predict`` does it: the argmax of ``predict_proba`` mapped to the class labels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from airflow_provider_batchinfer.registry.tabular import read_settings
from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor
from airflow_provider_batchinfer.runtime.model.flavors.tabular.tabular_inputs import (
    CPU_CALL_ROWS,
    TRANSFER_ROWS,
    chunked,
    frame,
    matrix,
    ordered,
    proba_outputs,
)


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    import lightgbm as lgb

    settings = read_settings(model_dir, manifest)
    booster = lgb.Booster(model_file=str(model_dir / manifest["options"]["dir"] / settings["file"]))
    outputs = list(settings["output_order"])
    methods, categorical = settings["methods"], settings["categorical"]
    classes = np.asarray(settings["classes"]) if settings.get("classes") else None
    nthreads = max(1, threads)

    def score(x: Any) -> dict[str, Any]:
        raw = booster.predict(x, num_threads=nthreads)
        if classes is None:
            return {"prediction": raw}
        proba = raw if raw.ndim == 2 else np.vstack((1.0 - raw, raw)).transpose()
        out: dict[str, Any] = {}
        if "predict" in methods:
            out["prediction"] = classes[np.argmax(proba, axis=1)]
        if "predict_proba" in methods:
            out.update(proba_outputs(proba, outputs, settings["proba"]))
        return out

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        inputs = ordered(inputs, settings)
        x = frame(inputs, categorical) if categorical else matrix(inputs)
        return chunked(score, x, inputs.num_rows, max_rows)

    return predict


FLAVOR = Flavor(
    name="lightgbm",
    load=load,
    allows_missing=True,  # NaN is LightGBM's missing value
    transfer_rows=TRANSFER_ROWS,
    cpu_call_rows=CPU_CALL_ROWS,
)
