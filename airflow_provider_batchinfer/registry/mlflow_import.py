"""MLflow models into the registry: resolved to one version, copied, every file hashed.

``log_model(name, version, "mlflow", "models:/churn@champion")`` asks MLflow which model version the
URI means *now*, downloads exactly that version's files (never the alias again), and logs them as
an immutable version whose manifest records the URI, the resolved version and where it came from.
A job then pins those bytes by sha256: moving the alias in MLflow later changes nothing for it.

Which flavor runs the copy: the native one where this provider has it (``mlflow_native.py``), so a
transformers model runs as ``transformers_pipeline`` without MLflow on the workers; anything else
runs as ``mlflow_pyfunc`` (``mlflow.pyfunc.load_model`` on each replica). pyfunc loaders unpickle
(cloudpickled Python models, pickled estimators; MLflow itself refuses them unless
``MLFLOW_ALLOW_PICKLE_DESERIALIZATION`` is set), so that path needs an explicit
``trust_pickle=True``, recorded in the manifest and printed in the job log.

Tracking server: ``tracking_uri=`` (the hook passes the connection extra ``mlflow_tracking_uri``),
else ``MLFLOW_TRACKING_URI``. Nothing here touches MLflow's process-wide settings.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from airflow_provider_batchinfer.registry.mlflow_native import MLMODEL_NATIVE, TABULAR_NATIVE, tabular_source
from airflow_provider_batchinfer.registry.pipelines import (
    PIPELINE_FLAVOR,
    canonical_task,
    check_pipeline_dir,
    pipeline_signature,
)
from airflow_provider_batchinfer.registry.versions import FLAVORS, RegistryError

if TYPE_CHECKING:
    pass

PYFUNC_FLAVOR = "mlflow_pyfunc"
MLMODEL_DIR = "artifact"  # the MLflow model directory, as downloaded, inside the version

# MLflow column types -> signature dtypes
_MLFLOW_TYPES = {
    "boolean": "bool",
    "integer": "int32",
    "long": "int64",
    "float": "float32",
    "double": "float64",
    "string": "string",
    "binary": "binary",
    "datetime": "timestamp",
}
_MODELS_VERSION = re.compile(r"^models:/(?P<name>[^/@]+)/(?P<version>\d+)$")
_MODELS_ALIAS = re.compile(r"^models:/(?P<name>[^/@]+)@(?P<alias>[^/@]+)$")
_MODELS_ID = re.compile(r"^models:/(?P<model_id>m-[0-9a-f]+)$")
_RUNS = re.compile(r"^runs:/(?P<run_id>[^/]+)/(?P<path>.+)$")


def _redact(uri: str | None) -> str | None:
    """A tracking URI without user:password (it goes into the manifest and the logs)."""
    if not uri:
        return uri
    parts = urlsplit(uri)
    if parts.password or parts.username:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def _client(tracking_uri: str | None, registry_uri: str | None) -> tuple[Any, str]:
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise RegistryError(
            "logging an MLflow model needs mlflow-skinny: pip install 'airflow-provider-batchinfer[mlflow]'"
        ) from None
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        raise RegistryError(
            "no MLflow tracking server given: pass tracking_uri=..., set the connection extra "
            "'mlflow_tracking_uri', or MLFLOW_TRACKING_URI"
        )
    return MlflowClient(tracking_uri, registry_uri or tracking_uri), tracking_uri


def resolve_mlflow_uri(client: Any, uri: str) -> tuple[str, dict[str, Any]]:
    """(the artifact location of exactly one model, what the manifest records about it).

    ``models:/<name>@<alias>`` is resolved to its version here, once; the files are then read from
    that version's own location, so an alias moved mid-copy cannot mix two versions."""
    from mlflow.exceptions import MlflowException

    origin: dict[str, Any] = {"uri": uri}
    try:
        if m := _MODELS_ALIAS.match(uri):
            mv = client.get_model_version_by_alias(m["name"], m["alias"])
            origin.update(registered_model=m["name"], alias=m["alias"])
        elif m := _MODELS_VERSION.match(uri):
            mv = client.get_model_version(m["name"], m["version"])
            origin.update(registered_model=m["name"])
        elif m := _MODELS_ID.match(uri):
            logged = client.get_logged_model(m["model_id"])
            origin.update(model_id=logged.model_id, run_id=logged.source_run_id)
            return logged.artifact_location, origin
        elif m := _RUNS.match(uri):
            return _resolve_run(client, m["run_id"], m["path"].strip("/"), origin)
        else:
            raise RegistryError(
                f"MLflow model URI {uri!r} is not supported: use models:/<name>/<version>, models:/<name>@<alias>, "
                "models:/<model id> or runs:/<run id>/<path> (stages and 'latest' move; pin a version or an alias)"
            )
        origin.update(
            version=str(mv.version), run_id=mv.run_id, source=mv.source, resolved_uri=f"models:/{mv.name}/{mv.version}"
        )
        return client.get_model_version_download_uri(mv.name, mv.version), origin
    except MlflowException as exc:
        raise RegistryError(f"MLflow could not resolve {uri!r}: {exc.message}") from None


def _resolve_run(client: Any, run_id: str, path: str, origin: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``runs:/<run>/<path>``: a model logged into the run's artifacts (MLflow 2) or, in MLflow 3, a
    logged model of that name whose source run is ``run_id``."""
    run = client.get_run(run_id)
    origin["run_id"] = run_id
    # logged models first: MLflow 3's list_artifacts resolves a logged model's name through the
    # process-wide tracking URI, not this client's
    found = client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run_id}' AND name = '{path}'"
    )
    if found:
        origin["model_id"] = found[0].model_id
        return found[0].artifact_location, origin
    if any(f.path.rstrip("/").endswith("MLmodel") for f in client.list_artifacts(run_id, path)):
        return f"{run.info.artifact_uri.rstrip('/')}/{path}", origin
    raise RegistryError(f"MLflow run {run_id} has no model at {path!r} (neither a logged model nor run artifacts)")


def read_mlmodel(model_dir: Path) -> dict[str, Any]:
    import yaml

    mlmodel = model_dir / "MLmodel"
    if not mlmodel.exists():
        raise RegistryError(f"the MLflow artifact has no MLmodel file ({sorted(p.name for p in model_dir.iterdir())})")
    return yaml.safe_load(mlmodel.read_text()) or {}


def mlflow_signature(mlmodel: dict[str, Any]) -> dict[str, Any] | None:
    """The MLmodel's column signature in this registry's shape, or None when it has none or is
    tensor-based (then the caller must give one). Unnamed outputs are called ``prediction``."""
    sig = mlmodel.get("signature") or {}
    if not sig.get("inputs"):
        return None
    inputs = json.loads(sig["inputs"])
    outputs = json.loads(sig["outputs"]) if sig.get("outputs") else []
    if any(c.get("type") == "tensor" or "name" not in c for c in inputs):
        return None
    result: dict[str, Any] = {"inputs": {c["name"]: _MLFLOW_TYPES.get(str(c.get("type")), "any") for c in inputs}}
    out: dict[str, str] = {}
    for i, c in enumerate(outputs):
        dtype = "any" if c.get("type") == "tensor" else _MLFLOW_TYPES.get(str(c.get("type")), "any")
        out[c.get("name") or ("prediction" if len(outputs) == 1 else f"prediction_{i}")] = dtype
    result["outputs"] = out or {"prediction": "any"}
    return result


def _transformers_options(model_dir: Path, conf: dict[str, Any], task: str | None) -> dict[str, Any]:
    """Options for running MLflow's transformers flavor natively (``model/`` + ``components/``)."""
    task = task or conf.get("task")
    binary = conf.get("model_binary")
    if not binary or not (model_dir / binary).is_dir():
        raise RegistryError(
            "this MLflow transformers model holds no weights (logged with save_pretrained=False, a reference to "
            "a hub repository): re-log it with save_pretrained=True, models are never downloaded at run time"
        )
    if task is None:
        raise RegistryError("the MLflow transformers model records no task; pass task=...")
    name = canonical_task(task)
    options: dict[str, Any] = {"dir": f"{MLMODEL_DIR}/{binary}", "task": task}
    for part in conf.get("components") or []:
        if (model_dir / "components" / part).is_dir():
            options[part] = f"{MLMODEL_DIR}/components/{part}"
    check_pipeline_dir(model_dir / binary, name, [model_dir / "components" / p for p in conf.get("components") or []])
    return options


def choose_flavor(mlmodel: dict[str, Any], native: bool) -> tuple[str, str | None]:
    """(this provider's flavor, the MLflow flavor it reads, or None for pyfunc)."""
    flavors = mlmodel.get("flavors") or {}
    if native:
        for mlflow_flavor, ours in MLMODEL_NATIVE.items():
            if mlflow_flavor in flavors and ours in FLAVORS:
                return ours, mlflow_flavor
    if "python_function" not in flavors:
        raise RegistryError(
            f"this MLflow model has no python_function flavor and none this provider runs natively "
            f"(its flavors: {sorted(flavors)})"
        )
    return PYFUNC_FLAVOR, None


def _stage_tabular_copy(
    staging: Path,
    flavor: str,
    conf: dict[str, Any],
    signature: dict[str, Any] | None,
    trust_pickle: bool,
    trusted_types: list[str] | None,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Stage an MLflow tabular model for its native flavor: the MLflow directory moves to
    ``mlflow/`` (kept and hashed: its MLmodel is the provenance) and ``registry/tabular.py``
    writes ``artifact/`` from the model file in it. None: not readable natively, use pyfunc."""
    from airflow_provider_batchinfer.registry.tabular import stage_tabular  # type: ignore[import-not-found,unused-ignore]

    mlflow_dir = staging / "mlflow"
    os.replace(staging / MLMODEL_DIR, mlflow_dir)
    scratch = staging.parent / "scratch"
    scratch.mkdir(exist_ok=True)
    found = tabular_source(
        flavor, mlflow_dir, conf, {"trust_pickle": trust_pickle, "trusted_types": trusted_types}, scratch
    )
    if found is None:
        os.replace(mlflow_dir, staging / MLMODEL_DIR)
        return None
    path, settings = found
    options, sig = stage_tabular(staging / MLMODEL_DIR, flavor, str(path), signature, settings)
    return {**options, "mlflow_dir": "mlflow"}, sig


@dataclass(frozen=True)
class StagedModel:
    """An MLflow model staged for the registry: the directory the store commits, and what its
    manifest says (the ``mlflow`` section is where the model came from)."""

    directory: Path
    flavor: str
    signature: dict[str, Any]
    options: dict[str, Any]
    origin: dict[str, Any]


def stage_mlflow_model(
    uri: Any,
    workdir: Path,
    *,
    signature: dict[str, Any] | None = None,
    tracking_uri: str | None = None,
    registry_uri: str | None = None,
    trust_pickle: bool = False,
    native: bool = True,
    task: str | None = None,
    trusted_types: list[str] | None = None,
) -> StagedModel:
    """Download the MLflow model at ``uri`` into ``workdir`` (an empty directory the caller removes)
    and stage it as a version's files (see the module doc); the registry commits it.

    ``native=False`` runs it as ``mlflow_pyfunc`` even where a native flavor exists; ``task``
    overrides the task an MLflow transformers model records; ``trusted_types`` names the types of
    an MLflow skops file that its native ``sklearn`` copy may load."""
    if not isinstance(uri, str):
        raise RegistryError(
            f"an MLflow model is given by its URI (models:/<name>/<version>, ...), got {type(uri).__name__}"
        )
    client, tracking_uri = _client(tracking_uri, registry_uri)
    location, origin = resolve_mlflow_uri(client, uri)
    from mlflow.artifacts import download_artifacts

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    staging = workdir / "version"
    staging.mkdir()
    downloaded = Path(
        download_artifacts(artifact_uri=location, dst_path=str(workdir / "dl"), tracking_uri=tracking_uri)
    )
    os.replace(downloaded, staging / MLMODEL_DIR)
    model_dir = staging / MLMODEL_DIR
    mlmodel = read_mlmodel(model_dir)
    flavor, source = choose_flavor(mlmodel, native)
    staged = None
    if flavor in TABULAR_NATIVE and source is not None:
        staged = _stage_tabular_copy(
            staging, flavor, mlmodel["flavors"][source], signature, trust_pickle, trusted_types
        )
        if staged is None:
            flavor = PYFUNC_FLAVOR
    if staged is not None:
        options, sig = staged
    elif flavor == PIPELINE_FLAVOR:
        options = _transformers_options(model_dir, mlmodel["flavors"]["transformers"], task)
        sig = pipeline_signature(options["task"], signature)
    else:
        if not trust_pickle:
            raise RegistryError(
                f"MLflow model {uri} runs as {PYFUNC_FLAVOR} (flavors: {sorted(mlmodel.get('flavors') or {})}), "
                "whose loader may unpickle and so run code from the model files; log it with trust_pickle=True "
                "if you trust its source (recorded in the version's manifest and printed in the job log)"
            )
        given = signature or mlflow_signature(mlmodel)
        if given is None:
            raise RegistryError(
                f"MLflow model {uri} has no column signature (none, or tensor-based); pass "
                "signature={'inputs': {column: dtype}, 'outputs': {column: dtype}}"
            )
        from airflow_provider_batchinfer.registry.artifacts import normalize_signature

        sig = normalize_signature(given, flavor)
        options = {"dir": MLMODEL_DIR, "trust_pickle": True}
    origin.update(
        tracking_uri=_redact(tracking_uri),
        flavors=sorted(mlmodel.get("flavors") or {}),
        mlflow_version=mlmodel.get("mlflow_version"),
        model_uuid=mlmodel.get("model_uuid"),
    )
    return StagedModel(staging, flavor, sig, options, origin)


__all__ = ["PYFUNC_FLAVOR", "StagedModel", "mlflow_signature", "resolve_mlflow_uri", "stage_mlflow_model"]
