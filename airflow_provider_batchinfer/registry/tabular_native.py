"""Staging XGBoost, LightGBM and ONNX models in their own formats, with the signature each model
knows (feature names and types, ONNX graph inputs). See ``registry/tabular.py`` for the shared rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.tabular_base import (
    chosen_methods,
    copy_model_file,
    is_path,
    output_columns,
    read_feature_names,
)
from airflow_provider_batchinfer.registry.versions import RegistryError

# --- XGBoost ---------------------------------------------------------------------------------------------

_XGB_TYPES = {"c": "category", "int": "number", "i": "number", "q": "number", "float": "number"}


def stage_xgboost(art: Path, artifact: Any, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Booster or an XGBModel (XGBClassifier, XGBRegressor...), saved as UBJ (default, XGBoost's
    own default since 2.1) or JSON (``format="json"``, readable). UBJ loads faster: a 200-tree
    depth-8 model in 0.01 s instead of 0.07 s, on every job's start."""
    import xgboost as xgb

    fmt = options.get("format", "ubj")
    if fmt not in ("json", "ubj"):
        raise RegistryError(f"an xgboost model is stored as format='json' or 'ubj', got {fmt!r}")
    estimator = None
    if is_path(artifact):
        suffix = Path(artifact).suffix.lstrip(".")
        if suffix not in ("json", "ubj"):
            raise RegistryError(f"{artifact}: an xgboost model file must be .json or .ubj (never a pickle)")
        fmt = suffix
        copy_model_file(artifact, art, f"model.{fmt}")
        booster = xgb.Booster(model_file=str(art / f"model.{fmt}"))
    elif isinstance(artifact, xgb.XGBModel):
        estimator = type(artifact).__name__
        artifact.save_model(str(art / f"model.{fmt}"))
        booster = artifact.get_booster()
    elif isinstance(artifact, xgb.Booster):
        artifact.save_model(str(art / f"model.{fmt}"))
        booster = artifact
    else:
        raise RegistryError(f"an xgboost model must be a Booster, an XGBModel or a .json/.ubj path, got {artifact!r}")
    if estimator is None:
        saved = xgb.Booster(model_file=str(art / f"model.{fmt}"))
        estimator = _xgb_estimator_of(saved)
    features = read_feature_names(options, booster.feature_names, booster.num_features(), "xgboost booster")
    types = booster.feature_types or ["float"] * len(features)
    inputs = {f: _XGB_TYPES.get(t, "number") for f, t in zip(features, types, strict=True)}
    methods = chosen_methods(options, ("predict", "predict_proba"))
    if estimator is None and methods != ["predict"]:
        raise RegistryError("predict_proba needs an XGBClassifier; a bare Booster gives predict (its raw output)")
    classes = None
    if estimator == "XGBClassifier":
        loaded = xgb.XGBClassifier()
        loaded.load_model(str(art / f"model.{fmt}"))
        classes = [int(c) for c in loaded.classes_]
    pred = "int64" if estimator == "XGBClassifier" else "float32"
    outputs = output_columns(methods, classes, options.get("proba", "columns"), pred)
    if estimator is None and booster.num_boosted_rounds() and _xgb_groups(booster) > 1:
        outputs = {"prediction": "list<float32>"}
    settings = {
        "file": f"model.{fmt}",
        "format": fmt,
        "estimator": estimator,
        "methods": methods,
        "proba": options.get("proba", "columns"),
        "categorical": [f for f, t in inputs.items() if t == "category"],
    }
    return settings, {"inputs": inputs, "outputs": outputs}


def _xgb_estimator_of(booster: Any) -> str | None:
    """The scikit-learn wrapper a saved model came from (XGBModel.save_model records it), if any."""
    attr = booster.attr("scikit_learn")
    if attr:
        kind = json.loads(attr).get("_estimator_type")
        return {"classifier": "XGBClassifier", "regressor": "XGBRegressor"}.get(kind)
    return None


def _xgb_groups(booster: Any) -> int:
    config = json.loads(booster.save_config())
    return int(config["learner"]["learner_model_param"].get("num_class", "0") or 0)


# --- LightGBM --------------------------------------------------------------------------------------------


def stage_lightgbm(art: Path, artifact: Any, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Booster or an LGBMModel, saved as LightGBM's text model; a classifier's classes go into
    flavor.json (the text file does not hold them) so ``predict`` gives the same labels."""
    import lightgbm as lgb

    classes = None
    if is_path(artifact):
        copy_model_file(artifact, art, "model.txt")
        booster = lgb.Booster(model_file=str(art / "model.txt"))
        estimator = None
    elif isinstance(artifact, lgb.LGBMModel):
        booster, estimator = artifact.booster_, type(artifact).__name__
        if isinstance(artifact, lgb.LGBMClassifier):
            classes = [c.item() if hasattr(c, "item") else c for c in artifact.classes_]
        booster.save_model(str(art / "model.txt"))
    elif isinstance(artifact, lgb.Booster):
        booster, estimator = artifact, None
        booster.save_model(str(art / "model.txt"))
    else:
        raise RegistryError(f"a lightgbm model must be a Booster, an LGBMModel or a text model path, got {artifact!r}")
    saved = lgb.Booster(model_file=str(art / "model.txt"))
    names = saved.feature_name()
    features = read_feature_names(options, names, saved.num_feature(), "lightgbm booster")
    cat_index = saved.params.get("categorical_feature") or []
    cat_index = [
        int(i) for i in (cat_index if isinstance(cat_index, list) else str(cat_index).split(",") if cat_index else [])
    ]
    categorical = [features[i] for i in cat_index]
    inputs = {f: "category" if f in categorical else "number" for f in features}
    methods = chosen_methods(options, ("predict", "predict_proba"))
    if classes is None and methods != ["predict"]:
        raise RegistryError("predict_proba needs an LGBMClassifier; a bare Booster gives predict (its raw output)")
    pred = "float64"
    if classes:
        pred = "string" if isinstance(classes[0], str) else "int64"
    outputs = output_columns(methods, classes, options.get("proba", "columns"), pred)
    if classes is None and saved.num_model_per_iteration() > 1:
        outputs = {"prediction": "list<float64>"}
    settings = {
        "file": "model.txt",
        "format": "lightgbm-text",
        "estimator": estimator,
        "classes": classes,
        "methods": methods,
        "proba": options.get("proba", "columns"),
        "categorical": categorical,
    }
    return settings, {"inputs": inputs, "outputs": outputs}


# --- ONNX ----------------------------------------------------------------------------------------------------

_ONNX_TYPES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    8: "string",
}


def stage_onnx(art: Path, artifact: Any, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An ``onnx.ModelProto`` or a ``.onnx`` path. Each graph input of width 1 is one column named
    after it; a wider input is one list column, or the columns ``feature_names`` names (a list for a
    single input, ``{input: [columns]}`` for several) stacked in that order."""
    import onnx

    if is_path(artifact):
        copy_model_file(artifact, art, "model.onnx")
    elif isinstance(artifact, onnx.ModelProto):
        onnx.save(artifact, str(art / "model.onnx"))
    elif isinstance(artifact, (bytes, bytearray)):
        (art / "model.onnx").write_bytes(bytes(artifact))
    else:
        raise RegistryError(f"an onnx model must be an onnx.ModelProto, its bytes or a .onnx path, got {artifact!r}")
    try:
        model = onnx.load(str(art / "model.onnx"))
        onnx.checker.check_model(model)
    except Exception as exc:
        raise RegistryError(f"the onnx model does not load or check: {type(exc).__name__}: {exc}") from exc
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in initializers]
    given = options.get("feature_names")
    if isinstance(given, (list, tuple)):
        if len(graph_inputs) != 1:
            raise RegistryError("feature_names as a list needs a one-input model; pass {input name: [columns]}")
        given = {graph_inputs[0].name: list(given)}
    given = dict(given or {})
    plan, inputs = [], {}
    for gi in graph_inputs:
        tensor = gi.type.tensor_type
        dtype = _ONNX_TYPES.get(tensor.elem_type)
        if dtype is None:
            raise RegistryError(f"onnx input {gi.name!r} has an unsupported type (elem_type {tensor.elem_type})")
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        width = dims[1] if len(dims) == 2 else 1 if len(dims) == 1 else None
        if len(dims) > 2:
            raise RegistryError(f"onnx input {gi.name!r} has rank {len(dims)}; only [batch] and [batch, k] are mapped")
        cols = given.pop(gi.name, None)
        if cols is not None:
            if width is not None and len(cols) != width:
                raise RegistryError(f"feature_names for {gi.name!r} has {len(cols)} columns, the input takes {width}")
            inputs.update(dict.fromkeys(cols, dtype))
        elif width == 1:
            cols = [gi.name]
            inputs[gi.name] = dtype
        else:
            inputs[gi.name] = f"list<{dtype}>"
        plan.append({"name": gi.name, "dtype": dtype, "rank": len(dims), "columns": cols})
    if given:
        raise RegistryError(f"feature_names names inputs {sorted(given)} that the onnx model does not have")
    outputs = {}
    for go in model.graph.output:
        if go.type.HasField("tensor_type") and go.type.tensor_type.elem_type in _ONNX_TYPES:
            dims = go.type.tensor_type.shape.dim
            dtype = _ONNX_TYPES[go.type.tensor_type.elem_type]
            wide = len(dims) == 2 and not (dims[1].HasField("dim_value") and dims[1].dim_value == 1)
            outputs[go.name] = f"list<{dtype}>" if wide or len(dims) > 2 else dtype
    if not outputs:
        raise RegistryError(
            "the onnx model has no tensor outputs (a skl2onnx classifier: export with options={'zipmap': False})"
        )
    return {"file": "model.onnx", "format": "onnx", "inputs": plan, "outputs": list(outputs)}, {
        "inputs": inputs,
        "outputs": outputs,
    }
