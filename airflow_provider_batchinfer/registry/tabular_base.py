"""What every tabular stager shares: a model's feature names, its methods and output columns, the
dtypes of an input example, and copying its file. ``tabular.py`` (scikit-learn, and the choice of
stager) and ``tabular_native.py`` (XGBoost, LightGBM, ONNX) both build on it."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.versions import RegistryError


def arrow_dtype(arrow_type: Any) -> str:
    """A signature dtype for an Arrow type: what ``runtime/planning/pipeline.py`` checks input columns against."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        return "category"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_integer(arrow_type):
        return str(arrow_type)
    if pa.types.is_floating(arrow_type):
        return f"float{arrow_type.bit_width}"
    return "any"


def example_dtypes(example: Any) -> dict[str, str]:
    """``{column: dtype}`` of an input example (pandas DataFrame or pyarrow Table), in its order."""
    import pyarrow as pa

    table = example if isinstance(example, pa.Table) else pa.Table.from_pandas(example, preserve_index=False)
    return {f.name: arrow_dtype(f.type) for f in table.schema}


def read_feature_names(options: dict[str, Any], known: list[str] | None, count: int | None, what: str) -> list[str]:
    """The model's features in fit order: its own names, else ``feature_names``, else the example's."""
    given = options.get("feature_names")
    example = options.get("input_example")
    if known:
        if given is not None and list(given) != list(known):
            raise RegistryError(f"feature_names {list(given)} differ from the names the {what} was fitted with {known}")
        return list(known)
    names = list(given) if given is not None else list(example_dtypes(example)) if example is not None else []
    if not names:
        raise RegistryError(
            f"the {what} was fitted without feature names: pass feature_names=[...] (the input columns in fit "
            "order) or input_example=<a few rows as a DataFrame>"
        )
    if count is not None and len(names) != count:
        raise RegistryError(f"feature_names has {len(names)} names but the {what} takes {count} features")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise RegistryError(f"feature_names must be distinct non-empty strings, got {names}")
    return names


def class_column(cls: Any) -> str:
    """``proba_<class>``: a column name for one class's probability."""
    return "proba_" + re.sub(r"[^A-Za-z0-9_.-]", "_", str(cls))


def copy_model_file(artifact: Any, art: Path, name: str) -> None:
    src = Path(artifact)
    if not src.is_file():
        raise RegistryError(f"model file {src} does not exist")
    shutil.copyfile(src, art / name)


def is_path(artifact: Any) -> bool:
    return isinstance(artifact, (str, os.PathLike))


def chosen_methods(options: dict[str, Any], allowed: tuple[str, ...]) -> list[str]:
    method = options.get("method", "predict")
    methods = [method] if isinstance(method, str) else list(method)
    bad = [m for m in methods if m not in allowed]
    if bad or not methods:
        raise RegistryError(f"method must be one of {list(allowed)} (or a list of them), got {method!r}")
    return methods


def output_columns(methods: list[str], classes: list[Any] | None, proba: str, prediction_dtype: str) -> dict[str, str]:
    """Output columns: ``prediction``; with ``predict_proba`` one ``proba_<class>`` column per class
    (``proba="columns"``) or one ``probabilities`` list column (``proba="list"``)."""
    if proba not in ("columns", "list"):
        raise RegistryError(f"proba must be 'columns' or 'list', got {proba!r}")
    out: dict[str, str] = {}
    if "predict" in methods:
        out["prediction"] = prediction_dtype
    if "predict_proba" in methods:
        if not classes:
            raise RegistryError("method='predict_proba' needs a classifier (the model has no classes_)")
        if proba == "list":
            out["probabilities"] = "list<float64>"
        else:
            names = [class_column(c) for c in classes]
            if len(set(names)) != len(names):
                raise RegistryError(f"classes {classes} give clashing column names; use proba='list'")
            out.update(dict.fromkeys(names, "float64"))
    return out
