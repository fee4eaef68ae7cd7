"""scikit-learn estimators and pipelines (``sklearn`` flavor).

Stored with ``skops.io``: loading it instantiates only the types recorded as trusted when the model
was logged (``flavor.json``, hashed with the model), and any other type in the file fails the job
before a row is scored, naming the type. A ``joblib`` pickle loads only when it was logged with
``trust_pickle=True``, and every job says so in its log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.tabular import UntrustedModelError, read_settings
from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor
from airflow_provider_batchinfer.runtime.model.flavors.tabular.tabular_inputs import (
    CPU_CALL_ROWS,
    TRANSFER_ROWS,
    chunked,
    matrix,
    ordered,
    proba_outputs,
)

_PICKLE_WARNING = (
    "WARNING: model {name}/{version} is a pickle (joblib), loaded because it was logged with "
    "trust_pickle=True: unpickling runs arbitrary code, so use it only for a file you produced yourself"
)


def preflight(model_dir: Path | None, manifest: dict[str, Any]) -> list[str]:
    """Checks that need the model's files but no compute: untrusted skops types, an unflagged
    pickle (``model_dir`` None: an object-store model only the replicas fetch; they run this
    before loading). Returns the lines to print in the job log."""
    options = manifest["options"]
    if model_dir is None:
        return [_PICKLE_WARNING.format(**manifest)] if options.get("trust_pickle") else []
    settings = read_settings(model_dir, manifest)
    path = model_dir / options["dir"] / settings["file"]
    if settings["format"] == "joblib":
        if not (settings.get("trust_pickle") and options.get("trust_pickle")):
            raise UntrustedModelError(
                f"model {manifest['name']}/{manifest['version']} is a pickle that was not logged with "
                "trust_pickle=True; refusing to unpickle it"
            )
        return [_PICKLE_WARNING.format(**manifest)]
    import skops.io as sio

    found = sio.get_untrusted_types(file=path)
    extra = sorted(set(found) - set(settings["trusted_types"]))
    if extra:
        raise UntrustedModelError(
            f"model file {path} holds types that were not trusted when model {manifest['name']}/"
            f"{manifest['version']} was logged: {', '.join(extra)}; refusing to load it"
        )
    return []


def _load_model(model_dir: Path, manifest: dict[str, Any], settings: dict[str, Any]) -> Any:
    preflight(model_dir, manifest)
    path = model_dir / manifest["options"]["dir"] / settings["file"]
    if settings["format"] == "joblib":
        import joblib

        return joblib.load(path)
    import skops.io as sio

    return sio.load(path, trusted=list(settings["trusted_types"]))


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    from threadpoolctl import threadpool_limits

    settings = read_settings(model_dir, manifest)
    model = _load_model(model_dir, manifest, settings)
    threadpool_limits(limits=max(1, threads))  # BLAS/OpenMP pools: the replica's share, not the machine
    features = list(settings["features"])
    outputs = list(settings["output_order"])
    methods, proba_format = settings["methods"], settings["proba"]
    # a model fitted on a DataFrame checks names (and a ColumnTransformer selects by them)
    named, numeric = settings["named"], all(v == "number" for v in manifest["signature"]["inputs"].values())

    def score(x: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "predict" in methods:
            out["prediction"] = model.predict(x)
        if "predict_proba" in methods:
            out.update(proba_outputs(model.predict_proba(x), outputs, proba_format))
        return out

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        inputs = ordered(inputs, settings)
        if numeric and not named:
            x: Any = matrix(inputs)
        else:
            x = inputs.to_pandas()
            if not named:
                x = x.to_numpy()
        if named:
            x = x[features] if list(x.columns) != features else x
        return chunked(score, x, inputs.num_rows, max_rows)

    return predict


FLAVOR = Flavor(
    name="sklearn",
    load=load,
    preflight=preflight,
    allows_missing=True,  # NaN reaches the estimator: HistGradientBoosting and imputers use it, others raise
    transfer_rows=TRANSFER_ROWS,
    cpu_call_rows=CPU_CALL_ROWS,
)
