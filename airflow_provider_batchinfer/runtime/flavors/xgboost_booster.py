"""XGBoost models in XGBoost's own format (``xgboost`` flavor): JSON or UBJ, never a pickle.

A bare ``Booster`` scores with ``inplace_predict`` (no DMatrix copy); a model logged from the
scikit-learn wrapper (``XGBClassifier``, ``XGBRegressor``) is reloaded as that wrapper, so
``prediction`` is exactly its ``predict`` (class labels for a classifier) and ``predict_proba`` its
probabilities. Threads: the replica's (``nthread``); on CPU calls of at least ``CPU_CALL_ROWS`` rows.
Missing values are NaN as in training; categorical features go through XGBoost's own pandas path,
which maps category names to the codes the model was trained with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from airflow_provider_batchinfer.registry.tabular import read_settings
from airflow_provider_batchinfer.runtime.flavors.tabular_inputs import (
    CPU_CALL_ROWS,
    TRANSFER_ROWS,
    chunked,
    frame,
    matrix,
    ordered,
    proba_outputs,
)

__all__ = ["CPU_CALL_ROWS", "TRANSFER_ROWS", "load"]
ALLOWS_MISSING = True  # NaN is XGBoost's missing value


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    import xgboost as xgb

    settings = read_settings(model_dir, manifest)
    path = str(model_dir / manifest["options"]["dir"] / settings["file"])
    estimator = settings.get("estimator")
    outputs = list(settings["output_order"])
    methods, categorical = settings["methods"], settings["categorical"]
    if estimator:
        wrapper = getattr(xgb, estimator)
        if not (isinstance(wrapper, type) and issubclass(wrapper, xgb.XGBModel)):
            raise ValueError(f"{estimator} is not an xgboost scikit-learn estimator")
        model = wrapper()
        model.load_model(path)
        model.set_params(n_jobs=max(1, threads))

        def score(x: Any) -> dict[str, Any]:
            out: dict[str, Any] = {}
            if "predict" in methods:
                out["prediction"] = model.predict(x)
            if "predict_proba" in methods:
                out.update(proba_outputs(model.predict_proba(x), outputs, settings["proba"]))
            return out

    else:
        booster = xgb.Booster(model_file=path)
        booster.set_param({"nthread": max(1, threads)})

        def score(x: Any) -> dict[str, Any]:
            return {"prediction": booster.inplace_predict(x)}

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        inputs = ordered(inputs, settings)
        # float32: XGBoost casts every value to float32 itself, so a float64 matrix is only a bigger copy
        x = frame(inputs, categorical) if categorical else matrix(inputs, np.float32)
        return chunked(score, x, inputs.num_rows, max_rows)

    return predict
