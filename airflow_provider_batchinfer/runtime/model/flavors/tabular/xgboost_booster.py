"""XGBoost models in XGBoost's own format (``xgboost`` flavor): JSON or UBJ, never a pickle.

A bare ``Booster`` scores with ``inplace_predict`` (no DMatrix copy); a model logged from the
scikit-learn wrapper (``XGBClassifier``, ``XGBRegressor``) is reloaded as that wrapper, so
``prediction`` is exactly its ``predict`` (class labels for a classifier) and ``predict_proba`` its
probabilities. Threads: the replica's (``nthread``); on CPU calls of ``cpu_call_rows`` rows unless
the job sets ``JobSpec.max_batch_rows``. Missing values are NaN (or null) as in training;
categorical features go through XGBoost's own pandas path, which maps category names to the codes
the model was trained with.

Numeric inputs go to XGBoost as one float32 matrix, not as the Arrow columns: XGBoost 3.x can
read Arrow columns in place, but its columnar predict then spends more CPU per value than the
copy saves (1M rows x 32 features, two threads: 2.85 CPU-s of prediction from Arrow, 2.69 from the
matrix, whose copy costs 0.06-0.12).

``concurrent_calls``: ``inplace_predict`` is lock-free and safe to call from several threads at
once (XGBoost's documentation), so a job scored in the driver (``runtime/engine/in_driver.py``) loads the
model with one thread and calls it from as many threads as the job has cores. Measured over 1M rows
x 32 features on two cores beside the reader and writer threads: two one-thread calls at a time
1.63-1.76 s, one two-thread call at a time 1.90-2.54 s. An OpenMP call ends when its slowest thread
does, and one of its two threads keeps losing its core to the reader or the writer; two independent
calls never wait for each other.
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
        if categorical:
            x = frame(inputs, categorical)
        else:  # float32: XGBoost casts every value to float32 itself, so a float64 matrix is only a bigger copy
            x = matrix(inputs, np.float32)
        return chunked(score, x, inputs.num_rows, max_rows)

    return predict


FLAVOR = Flavor(
    name="xgboost",
    load=load,
    allows_missing=True,  # NaN is XGBoost's missing value
    concurrent_calls=True,  # the predictor may be called from several threads at once (see above)
    transfer_rows=TRANSFER_ROWS,
    cpu_call_rows=CPU_CALL_ROWS,
)
