"""Staging traditional models: scikit-learn, XGBoost, LightGBM and ONNX.

Each model is written in a format that is safe to load (skops for scikit-learn, the libraries' own
model files for XGBoost and LightGBM, ONNX protobuf), and its signature is read from the model
where the model knows it: ``feature_names_in_``, a booster's feature names and types, an ONNX
graph's inputs. Beside the model goes ``artifact/flavor.json``: the settings the loader trusts
(file, format, trusted types, methods, feature order). It is hashed with the model, so editing it
after the log changes the version's sha256 like any other file.

A pickle (``joblib``) is written only with ``trust_pickle=True``; the flag is recorded in the
version's manifest and printed in every job's log. Unpickling runs arbitrary code: load only
pickles you produced yourself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry import tabular_native as native
from airflow_provider_batchinfer.registry.artifacts import normalize_signature
from airflow_provider_batchinfer.registry.tabular_base import (
    chosen_methods,
    copy_model_file,
    example_dtypes,
    is_path,
    output_columns,
    read_feature_names,
)
from airflow_provider_batchinfer.registry.versions import RegistryError

TABULAR_FLAVORS = ("sklearn", "xgboost", "lightgbm", "onnx")
FLAVOR_FILE = "flavor.json"  # beside the model in artifact/: hashed with it
PICKLE_SUFFIXES = (".pkl", ".pickle", ".joblib")


class UntrustedModelError(RegistryError):
    """A model file holds types nobody trusted (skops), or is a pickle without ``trust_pickle``."""

    permanent = True


def stage_tabular(
    art: Path, flavor: str, artifact: Any, signature: dict[str, Any] | None, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write ``artifact`` into ``art`` in its flavor's safe format; ``(manifest options, signature)``.

    A signature given by the author may refine dtypes but must name the model's own features in the
    model's order when the model knows them."""
    if artifact is None:
        raise RegistryError(f"a {flavor} model needs artifact=<the fitted model or a path to its file>")
    stager, allowed = _stager(flavor)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise RegistryError(
            f"log_model got {unknown} for a {flavor} model; it accepts {sorted(allowed)} besides the usual arguments"
        )
    art.mkdir()
    settings, inferred = stager(art, artifact, options)
    sig = normalize_signature(inferred if signature is None else signature, flavor)
    known = list(inferred["inputs"])
    if signature is not None and known and list(sig["inputs"]) != known:
        raise RegistryError(
            f"signature inputs {list(sig['inputs'])} do not match the {flavor} model's features {known} "
            "(names and order); leave signature out to use the model's own, or pass feature_names=[...]"
        )
    if not sig["inputs"]:
        raise RegistryError(f"the {flavor} model does not name its features: pass feature_names=[...] in fit order")
    # the order lives here: MODEL.json and the job file are written with sorted keys
    settings["features"] = list(sig["inputs"])
    settings["output_order"] = list(sig["outputs"])
    (art / FLAVOR_FILE).write_text(json.dumps(settings, indent=1, sort_keys=True))
    manifest_options = {"dir": "artifact", "file": settings["file"], "format": settings["format"]}
    if settings.get("trust_pickle"):
        manifest_options["trust_pickle"] = True
    return manifest_options, sig


def read_settings(model_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The loader's settings: ``artifact/flavor.json`` of a verified version."""
    return json.loads((model_dir / manifest["options"]["dir"] / FLAVOR_FILE).read_text())


# --- shared helpers ----------------------------------------------------------------------------------


# --- scikit-learn --------------------------------------------------------------------------------------


def _sklearn_dump(art: Path, artifact: Any, options: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """Write the model (skops, or joblib with trust_pickle); its settings and the loaded model."""
    import skops.io as sio

    trust_pickle = options.get("trust_pickle", False)
    if not isinstance(trust_pickle, bool):
        raise RegistryError(f"trust_pickle must be True or False, got {trust_pickle!r}")
    if (is_path(artifact) and str(artifact).endswith(PICKLE_SUFFIXES)) or (trust_pickle and not is_path(artifact)):
        if not trust_pickle:
            raise UntrustedModelError(
                f"{artifact} is a pickle, and unpickling runs arbitrary code: log the fitted estimator object "
                "instead (stored with skops), or pass trust_pickle=True if you produced this file yourself"
            )
        import joblib

        if is_path(artifact):
            copy_model_file(artifact, art, "model.joblib")
        else:
            joblib.dump(artifact, art / "model.joblib")
        model = joblib.load(art / "model.joblib")
        return {"file": "model.joblib", "format": "joblib", "trust_pickle": True, "trusted_types": []}, model
    path = art / "model.skops"
    if is_path(artifact):
        copy_model_file(artifact, art, "model.skops")
        found = sio.get_untrusted_types(file=path)
        trusted = list(options.get("trusted_types", []))
        extra = sorted(set(found) - set(trusted))
        if extra:
            raise UntrustedModelError(
                f"the skops file {artifact} holds types that are not trusted: {', '.join(extra)}; if you trust "
                "them, pass trusted_types=[...] naming them"
            )
    else:
        sio.dump(artifact, path)
        _canonical_skops(path)
        found = sio.get_untrusted_types(file=path)  # the model's own types: trusted, since they were logged
    try:
        model = sio.load(path, trusted=found)
    except Exception as exc:  # a type skops cannot persist: fail here, not on a worker
        raise RegistryError(f"skops cannot round-trip this model ({type(exc).__name__}: {exc})") from exc
    return {"file": "model.skops", "format": "skops", "trust_pickle": False, "trusted_types": sorted(found)}, model


def _canonical_skops(path: Path) -> None:
    """Rewrite a skops zip so the same model gives the same bytes: skops names entries and memo ids
    after ``id()`` of live objects and stamps entry times, which would give every log of one model
    a new content-addressed version (``version=None``) and defeat ``if_exists="reuse"``. Ids are
    renumbered in order of first appearance in ``schema.json``; entry times are fixed."""
    import zipfile

    with zipfile.ZipFile(path) as src:
        entries = {info.filename: src.read(info) for info in src.infolist()}
    schema = entries["schema.json"].decode("utf-8")
    pattern = re.compile(r'"__id__": (\d+)|"(\d+)(\.\w+)"')
    ids: dict[str, str] = {}
    for m in pattern.finditer(schema):
        ids.setdefault(m.group(1) or m.group(2), str(len(ids) + 1))

    def renumber(m: re.Match[str]) -> str:
        if m.group(1):
            return f'"__id__": {ids[m.group(1)]}'
        return f'"{ids[m.group(2)]}{m.group(3)}"'

    renamed = {"schema.json": pattern.sub(renumber, schema).encode("utf-8")}
    for name, data in entries.items():
        if name != "schema.json":
            stem, dot, ext = name.partition(".")
            renamed[f"{ids.get(stem, stem)}{dot}{ext}"] = data
    with zipfile.ZipFile(path, "w") as dst:  # stored, as sio.dump writes by default
        for name in sorted(renamed):
            dst.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), renamed[name])


def _sklearn_input_dtypes(model: Any, features: list[str], options: dict[str, Any]) -> dict[str, str]:
    """The input example's dtypes; else "number" when the model scores an all-zero numeric row
    (a model that needs strings, e.g. a OneHotEncoder on text, gets "any")."""
    example = options.get("input_example")
    if example is not None:
        dtypes = example_dtypes(example)
        missing = [f for f in features if f not in dtypes]
        if missing:
            raise RegistryError(f"input_example lacks the model's features {missing}")
        return {f: dtypes[f] for f in features}
    import numpy as np

    row: Any = np.zeros((1, len(features)))
    if hasattr(model, "feature_names_in_"):
        import pandas as pd

        row = pd.DataFrame(row, columns=features)
    try:
        model.predict(row)
        kind = "number"
    except Exception:
        kind = "any"
    return dict.fromkeys(features, kind)


def _stage_sklearn(art: Path, artifact: Any, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    settings, model = _sklearn_dump(art, artifact, options)
    if not callable(getattr(model, "predict", None)) and not callable(getattr(model, "predict_proba", None)):
        raise RegistryError(f"a sklearn model must be a fitted estimator with predict(), got {type(model).__name__}")
    known = [str(f) for f in getattr(model, "feature_names_in_", [])]
    features = read_feature_names(options, known, getattr(model, "n_features_in_", None), type(model).__name__)
    methods = chosen_methods(options, ("predict", "predict_proba"))
    classes = getattr(model, "classes_", None)
    classes = [c.item() if hasattr(c, "item") else c for c in classes] if classes is not None else None
    if classes and isinstance(classes[0], str):
        pred_dtype = "string"
    elif classes:
        pred_dtype = "int64" if all(isinstance(c, int) for c in classes) else "any"
    else:
        pred_dtype = "float64"
    outputs = output_columns(methods, classes, options.get("proba", "columns"), pred_dtype)
    settings.update(
        methods=methods,
        proba=options.get("proba", "columns"),
        named=bool(known),
        estimator=f"{type(model).__module__}.{type(model).__qualname__}",
    )
    return settings, {"inputs": _sklearn_input_dtypes(model, features, options), "outputs": outputs}


_COMMON = ("feature_names", "input_example", "method", "proba")
Stager = Callable[[Path, Any, dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


def _stager(flavor: str) -> tuple[Stager, tuple[str, ...]]:
    """The flavor's staging function and the keywords it accepts."""
    return {
        "sklearn": (_stage_sklearn, (*_COMMON, "trust_pickle", "trusted_types")),
        "xgboost": (native.stage_xgboost, (*_COMMON, "format")),
        "lightgbm": (native.stage_lightgbm, _COMMON),
        "onnx": (native.stage_onnx, ("feature_names",)),
    }[flavor]
