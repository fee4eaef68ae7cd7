"""Which MLflow models run on a native flavor instead of ``mlflow_pyfunc``, and from which file.

``MLMODEL_NATIVE`` maps an MLflow flavor to this provider's flavor; an entry applies only when
that flavor is registered (``FLAVORS``), so the tabular flavors (``sklearn``, ``xgboost``,
``lightgbm``, ``onnx``: ``registry/tabular.py``) take over as soon as they are installed beside
this module, and until then those models run as ``mlflow_pyfunc``.

For a tabular flavor, :func:`tabular_source` names the model file inside the MLflow model and the
settings ``registry.tabular.stage_tabular`` stages it with, or ``None`` when the MLflow model holds
no file the native flavor may read (LightGBM's scikit-learn API is a pickle: pyfunc it is).
MLflow's scikit-learn flavor is a skops file by default (MLflow >= 3): staged as a skops file whose
types the author must trust by name (``trusted_types=[...]``; the ``skops_trusted_types`` list in
the MLmodel file is the model's own claim and is never used). A pickle or cloudpickle file needs
``trust_pickle=True``, as for any scikit-learn pickle.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.pipelines import PIPELINE_FLAVOR
from airflow_provider_batchinfer.registry.versions import RegistryError

MLMODEL_NATIVE: dict[str, str] = {
    "transformers": PIPELINE_FLAVOR,
    "sklearn": "sklearn",
    "xgboost": "xgboost",
    "lightgbm": "lightgbm",
    "onnx": "onnx",
}
TABULAR_NATIVE = ("sklearn", "xgboost", "lightgbm", "onnx")


def tabular_source(
    flavor: str, model_dir: Path, conf: dict[str, Any], options: dict[str, Any], scratch: Path
) -> tuple[Path, dict[str, Any]] | None:
    """(model file, stage_tabular options) for MLflow flavor ``flavor``, or None for pyfunc."""
    if flavor == "sklearn":
        path = model_dir / str(conf.get("pickled_model") or "model.pkl")
        if conf.get("serialization_format") == "skops":
            return path, {"trusted_types": list(options.get("trusted_types") or [])}
        if not options.get("trust_pickle"):
            raise RegistryError(
                f"this MLflow scikit-learn model is a {conf.get('serialization_format')} file: unpickling runs code. "
                "Log it with trust_pickle=True if you trust its source, or re-log it in MLflow with "
                "serialization_format='skops'"
            )
        if path.suffix not in (".pkl", ".pickle", ".joblib"):
            shutil.copyfile(path, scratch / "model.pkl")
            path = scratch / "model.pkl"
        return path, {"trust_pickle": True}
    if flavor == "xgboost":
        path = model_dir / str(conf["data"])
        fmt = str(conf.get("model_format") or path.suffix.lstrip("."))
        if fmt in ("json", "ubj"):
            if path.suffix != f".{fmt}":
                shutil.copyfile(path, scratch / f"model.{fmt}")
                path = scratch / f"model.{fmt}"
            return path, {}
        import xgboost as xgb  # the deprecated binary format: read (no pickle), rewritten as JSON

        xgb.Booster(model_file=str(path)).save_model(str(scratch / "model.json"))
        return scratch / "model.json", {}
    if flavor == "lightgbm":
        if not str(conf.get("model_class", "")).endswith("Booster"):
            return None  # MLflow pickles LightGBM's scikit-learn API models
        return model_dir / str(conf["data"]), {}
    if flavor == "onnx":
        return model_dir / str(conf["data"]), {}
    raise RegistryError(f"no native mapping for MLflow flavor {flavor!r}")
