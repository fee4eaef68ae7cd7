"""MLflow models copied into the registry: URIs resolved once and pinned (an alias that moves later
changes nothing), every file hashed, the MLflow origin in the manifest; the pyfunc flavor behind an
explicit trust_pickle; an MLflow transformers model run natively as transformers_pipeline.

MLflow runs on a local file store in a temporary directory (``MLFLOW_ALLOW_FILE_STORE``); nothing
is downloaded. One module-scoped set-up logs a scikit-learn pipeline twice (versions 1 and 2 of
``ridge``, alias ``champion`` on 1) and a tiny transformers text classifier (``tc``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.registry import ModelRegistry, RegistryError, TamperedModelError
from airflow_provider_batchinfer.store.inputs import InputError
from airflow_provider_batchinfer.store.locations import sanitize_run_key
from tests import hf_support as hf
from tests.models import committed_manifest

FEATURES = [f"f{i}" for i in range(6)]
ATOL = 1e-5


def _frame(rows: int, seed: int):
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame(rng.normal(size=(rows, len(FEATURES))), columns=FEATURES)


@pytest.fixture(scope="module")
def ml(tmp_path_factory):
    """``{"tracking", "registry", "models": {"ridge_v1", "ridge_v2"}, ...}`` with MLflow's own
    process-wide tracking URI pointed elsewhere after logging: the import must not rely on it."""
    import mlflow
    from mlflow import MlflowClient
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from transformers import pipeline

    root = tmp_path_factory.mktemp("mlflow")
    tracking = f"file:{root / 'mlruns'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHINFER_HOME", str(root / "home"))
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mlflow.set_tracking_uri(tracking)
        train = _frame(300, seed=1)
        target = train.to_numpy() @ np.arange(1, 7) + 0.1
        models = {}
        for version, alpha in (("1", 1.0), ("2", 50.0)):
            models[f"ridge_v{version}"] = make_pipeline(StandardScaler(), Ridge(alpha=alpha)).fit(train, target)
            with mlflow.start_run():
                mlflow.sklearn.log_model(
                    models[f"ridge_v{version}"],
                    name="ridge",
                    input_example=train.head(3),
                    registered_model_name="ridge",
                    # given, MLflow skips inferring them in a subprocess that loads the model (~6 CPU-s a model)
                    pip_requirements=["scikit-learn"],
                )
        client = MlflowClient(tracking, tracking)
        client.set_registered_model_alias("ridge", "champion", "1")
        tc_dir = hf.build_text_classifier(root / "tc")
        with mlflow.start_run() as run:
            mlflow.transformers.log_model(
                pipeline("text-classification", model=str(tc_dir)),
                name="tc",
                registered_model_name="tc",
                pip_requirements=["transformers", "torch"],  # MLflow's defaults want torchvision
            )
        mlflow.set_tracking_uri(f"file:{root / 'elsewhere'}")
        yield {
            "root": root,
            "home": root / "home",
            "tracking": tracking,
            "client": client,
            "registry": ModelRegistry(str(root / "home" / "registry")),
            "models": models,
            "tc_dir": tc_dir,
            "tc_run": run.info.run_id,
        }


@pytest.fixture(scope="module")
def logged(ml):
    """The versions the tests and the DAG use: ridge@champion (pyfunc) and tc/1 (native)."""
    registry, tracking = ml["registry"], ml["tracking"]
    # native=False: pyfunc even once the native sklearn flavor is installed (see test_tabular_models_run_natively)
    pyfunc = {"tracking_uri": tracking, "trust_pickle": True, "native": False}
    registry.log_model("ridge", "champion", "mlflow", "models:/ridge@champion", **pyfunc)
    registry.log_model("ridge", "v1", "mlflow", "models:/ridge/1", **pyfunc)
    registry.log_model("mlflow_tc", "v1", "mlflow", "models:/tc/1", tracking_uri=tracking)
    return ml


def _predictor(registry: ModelRegistry, name: str, version: str, max_rows: int = 256):
    from airflow_provider_batchinfer.runtime.model.flavors import load_predictor

    model_dir = registry.local_copy(name, version)
    return load_predictor(model_dir, json.loads((model_dir / "MODEL.json").read_text()), "cpu", 1, max_rows)


# --- resolving, pinning, recording ----------------------------------------------------------------------


def test_an_alias_is_resolved_once_and_pinned_with_its_origin(logged, monkeypatch):
    registry, client = logged["registry"], logged["client"]
    champion = registry.read_manifest("ridge", "champion")
    assert champion["flavor"] == "mlflow_pyfunc" and champion["options"] == {"dir": "artifact", "trust_pickle": True}
    origin = champion["mlflow"]
    assert origin["uri"] == "models:/ridge@champion" and origin["alias"] == "champion"
    assert origin["version"] == "1" and origin["resolved_uri"] == "models:/ridge/1"
    assert origin["tracking_uri"] == logged["tracking"] and "sklearn" in origin["flavors"]
    assert origin["run_id"] == client.get_model_version("ridge", "1").run_id
    assert "artifact/MLmodel" in champion["files"] and all(len(f["sha256"]) == 64 for f in champion["files"].values())
    # the same bytes whichever URI named them
    assert registry.read_manifest("ridge", "v1")["sha256"] == champion["sha256"]
    assert champion["signature"] == {"inputs": dict.fromkeys(FEATURES, "float64"), "outputs": {"prediction": "float64"}}
    # the alias moves: the logged version does not, a new import gets the new bytes
    client.set_registered_model_alias("ridge", "champion", "2")
    try:
        moved = registry.log_model(
            "ridge",
            "moved",
            "mlflow",
            "models:/ridge@champion",
            tracking_uri=logged["tracking"],
            trust_pickle=True,
            native=False,
        )
        assert registry.read_manifest("ridge", "moved")["mlflow"]["version"] == "2"
        assert moved.sha256 != champion["sha256"] and registry.get("ridge", "champion").sha256 == champion["sha256"]
    finally:
        client.set_registered_model_alias("ridge", "champion", "1")
    # runs:/ (an MLflow 3 logged model found through its run) and models:/<model id>
    run_uri = f"runs:/{logged['tc_run']}/tc"
    by_run = registry.log_model("tc_run", "v1", "mlflow", run_uri, tracking_uri=logged["tracking"])
    assert by_run.sha256 == registry.get("mlflow_tc", "v1").sha256
    model_id = registry.read_manifest("tc_run", "v1")["mlflow"]["model_id"]
    by_id = registry.log_model("tc_id", "v1", "mlflow", f"models:/{model_id}", tracking_uri=logged["tracking"])
    assert by_id.sha256 == by_run.sha256


def test_a_transformers_model_runs_natively_without_trust(logged):
    import mlflow.pyfunc

    registry = logged["registry"]
    manifest = registry.read_manifest("mlflow_tc", "v1")
    assert manifest["flavor"] == "transformers_pipeline"
    assert manifest["options"] == {
        "dir": "artifact/model",
        "task": "text-classification",
        "tokenizer": "artifact/components/tokenizer",
    }
    assert manifest["signature"] == {"inputs": {"text": "string"}, "outputs": {"label": "string", "score": "float32"}}
    assert manifest["mlflow"]["resolved_uri"] == "models:/tc/1"
    texts = hf.texts(50, seed=5)
    out = _predictor(registry, "mlflow_tc", "v1")(pa.table({"text": texts}), {})
    own = mlflow.pyfunc.load_model(str(Path(registry.get("mlflow_tc", "v1").uri) / "artifact")).predict(texts)
    assert out["label"].to_pylist() == own["label"].tolist() and len(set(own["label"])) > 1
    np.testing.assert_allclose(out["score"].to_numpy(), own["score"].to_numpy(), atol=ATOL)


def test_pyfunc_predictions_equal_the_models_own(logged, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")  # the flavor turns it on; undone after
    frame = _frame(400, seed=9)
    out = _predictor(logged["registry"], "ridge", "champion")(pa.Table.from_pandas(frame), {})
    np.testing.assert_allclose(out["prediction"], logged["models"]["ridge_v1"].predict(frame), atol=ATOL, rtol=0)


def test_refusals_say_what_to_do_and_log_nothing(logged, tmp_path, monkeypatch):
    registry, tracking = logged["registry"], logged["tracking"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # mlflow.set_tracking_uri sets it
    with pytest.raises(RegistryError, match=r"runs as mlflow_pyfunc .* log it with trust_pickle=True if you trust"):
        registry.log_model("r", "v1", "mlflow", "models:/ridge/2", tracking_uri=tracking, native=False)
    with pytest.raises(RegistryError, match=r"'models:/ridge/latest' is not supported: use models:/<name>/<version>"):
        registry.log_model("r", "v1", "mlflow", "models:/ridge/latest", tracking_uri=tracking)
    with pytest.raises(RegistryError, match=r"MLflow could not resolve 'models:/nope/1'"):
        registry.log_model("r", "v1", "mlflow", "models:/nope/1", tracking_uri=tracking)
    with pytest.raises(
        RegistryError, match=r"no MLflow tracking server given: pass tracking_uri=.*mlflow_tracking_uri"
    ):
        registry.log_model("r", "v1", "mlflow", "models:/ridge/2")
    with pytest.raises(RegistryError, match=r"run .* has no model at 'nothing'"):
        registry.log_model("r", "v1", "mlflow", f"runs:/{logged['tc_run']}/nothing", tracking_uri=tracking)
    with pytest.raises(RegistryError, match=r"is logged from MLflow: flavor='mlflow', artifact='models:/...'"):
        registry.log_model("r", "v1", "mlflow_pyfunc", "/some/dir")
    assert registry.list_versions("r") == []


def test_the_hook_reads_the_tracking_uri_from_the_connection(logged, monkeypatch):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    home = logged["home"]
    conn = {
        "conn_type": "batchinfer",
        "extra": {
            "stage_root": str(home / "stage"),
            "registry_root": str(home / "registry"),
            "mlflow_tracking_uri": logged["tracking"],
        },
    }
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps(conn))
    mv = ModelServiceHook().log_model("ridge", "hooked", "mlflow", "models:/ridge/2", trust_pickle=True, native=False)
    assert (
        mv.flavor == "mlflow_pyfunc" and logged["registry"].read_manifest("ridge", "hooked")["mlflow"]["version"] == "2"
    )


def test_mlflow_signatures_and_tracking_uris_as_recorded():
    from airflow_provider_batchinfer.registry.mlflow_import import _redact, mlflow_signature

    cols = json.dumps(
        [{"type": "long", "name": "n"}, {"type": "string", "name": "s"}, {"type": "boolean", "name": "b"}]
    )
    outs = json.dumps([{"type": "float", "name": "p"}, {"type": "tensor", "tensor-spec": {}, "name": "t"}])
    assert mlflow_signature({"signature": {"inputs": cols, "outputs": outs}}) == {
        "inputs": {"n": "int64", "s": "string", "b": "bool"},
        "outputs": {"p": "float32", "t": "any"},
    }
    tensor = json.dumps([{"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": [-1, 4]}}])
    assert mlflow_signature({"signature": {"inputs": tensor}}) is None  # the author must give one
    assert mlflow_signature({}) is None
    assert _redact("https://bob:s3cret@mlflow.example.com:5000/x") == "https://mlflow.example.com:5000/x"
    assert _redact("databricks") == "databricks"


# --- MLflow's tabular flavors on the native ones (registry/mlflow_native.py) -------------------------------


def test_which_mlflow_files_a_native_tabular_flavor_may_read(tmp_path):
    from airflow_provider_batchinfer.registry.mlflow_native import tabular_source

    pickled = {"serialization_format": "cloudpickle", "pickled_model": "model.pkl"}
    with pytest.raises(
        RegistryError, match=r"is a cloudpickle file: unpickling runs code. Log it with trust_pickle=True"
    ):
        tabular_source("sklearn", tmp_path, pickled, {}, tmp_path)
    assert tabular_source("sklearn", tmp_path, pickled, {"trust_pickle": True}, tmp_path) == (
        tmp_path / "model.pkl",
        {"trust_pickle": True},
    )
    skops = {"serialization_format": "skops", "pickled_model": "model.skops", "skops_trusted_types": ["os.system"]}
    # the MLmodel's own trusted-types list is never used: only what the author names
    assert tabular_source("sklearn", tmp_path, skops, {}, tmp_path) == (tmp_path / "model.skops", {"trusted_types": []})
    sklearn_api = {"data": "model.lgb", "model_class": "lightgbm.sklearn.LGBMClassifier"}
    assert tabular_source("lightgbm", tmp_path, sklearn_api, {}, tmp_path) is None  # a pickle: pyfunc
    booster = {"data": "model.lgb", "model_class": "lightgbm.basic.Booster"}
    assert tabular_source("lightgbm", tmp_path, booster, {}, tmp_path) == (tmp_path / "model.lgb", {})


@pytest.mark.skipif(
    "sklearn" not in __import__("airflow_provider_batchinfer.registry", fromlist=["FLAVORS"]).FLAVORS,
    reason="the native sklearn flavor (registry/tabular.py) is not installed beside this branch",
)
def test_tabular_models_run_natively(logged, monkeypatch):
    """Activated by merging the tabular flavors: MLflow's skops scikit-learn model runs on the
    native ``sklearn`` flavor, with the MLflow directory kept (and hashed) under ``mlflow/``."""
    registry = logged["registry"]
    mv = registry.log_model("ridge_native", "v1", "mlflow", "models:/ridge/1", tracking_uri=logged["tracking"])
    manifest = registry.read_manifest("ridge_native", "v1")
    assert mv.flavor == "sklearn" and manifest["options"]["mlflow_dir"] == "mlflow"
    assert "mlflow/MLmodel" in manifest["files"] and manifest["mlflow"]["version"] == "1"
    assert list(mv.signature["inputs"]) == FEATURES
    frame = _frame(300, seed=4)
    out = _predictor(registry, "ridge_native", "v1")(pa.Table.from_pandas(frame), {})
    (column,) = list(mv.signature["outputs"])
    np.testing.assert_array_equal(np.asarray(out[column]), logged["models"]["ridge_v1"].predict(frame))


# --- bad inputs: before any compute, nothing committed ----------------------------------------------------


def test_bad_inputs_and_changed_files_fail_before_any_compute(logged, monkeypatch, tmp_path):
    registry = logged["registry"]
    frame = _frame(3, seed=2)

    def fails(model, table, match, error=(InputError,)):
        hf.assert_fails_before_ray(monkeypatch, tmp_path, registry, model, table, match, error)

    table = pa.Table.from_pandas(frame.drop(columns=["f3"])).append_column("id", pa.array([1, 2, 3]))
    fails("ridge", table, r"model input 'f3' needs column 'f3', which the input .* does not have")
    bad = pa.Table.from_pandas(frame).append_column("id", pa.array([1, 2, 3]))
    bad = bad.set_column(2, "f2", pa.array(["a", "b", "c"]))
    fails("ridge", bad, r"column 'f2' of .* is string, but model input 'f2' expects float64")
    fails(
        "mlflow_tc",
        pa.table({"id": [1], "text": [7]}),
        r"column 'text' of .* is int64, but model input 'text' expects string",
    )
    # a file changed after logging: the pyfunc's MLmodel and the native model's weights
    registry.log_model(
        "ridge_t", "v1", "mlflow", "models:/ridge/1", tracking_uri=logged["tracking"], trust_pickle=True, native=False
    )
    mlmodel = Path(registry.get("ridge_t", "v1").uri) / "artifact" / "MLmodel"
    mlmodel.write_text(mlmodel.read_text() + "\n# edited\n")
    fails(
        "ridge_t",
        bad.set_column(2, "f2", pa.array([0.1, 0.2, 0.3])),
        r"artifact/MLmodel does not match its recorded sha256",
        (TamperedModelError,),
    )
    registry.log_model("tc_t", "v1", "mlflow", "models:/tc/1", tracking_uri=logged["tracking"])
    weights = Path(registry.get("tc_t", "v1").uri) / "artifact" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    fails(
        "tc_t",
        pa.table({"id": [1], "text": ["a"]}),
        r"artifact/model/model.safetensors does not match its recorded sha256",
        (TamperedModelError,),
    )


# --- end to end through dag.test() --------------------------------------------------------------------


@pytest.mark.usefixtures("airflow_db")
def test_dag_scores_a_pinned_pyfunc_copy(logged, monkeypatch):
    """5000 rows through the pyfunc copy of ridge@champion, after the alias moved to version 2: the
    job still runs version 1's bytes and equals its own predict. (An MLflow transformers model runs
    on transformers_pipeline, whose end to end run is in tests/e2e/test_flavors_hf.py.)"""
    from tests.conftest import run_dag

    monkeypatch.setenv("BATCHINFER_HOME", str(logged["home"]))
    home, registry = logged["home"], logged["registry"]
    frame = _frame(5000, seed=21)
    (home / "in-tab").mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pandas(frame).append_column("id", pa.array(range(5000))), home / "in-tab" / "x.parquet"
    )
    logged["client"].set_registered_model_alias("ridge", "champion", "2")
    try:
        state, tasks, run_id = run_dag("bi_test_mlflow_models", tabular_input=str(home / "in-tab"))
    finally:
        logged["client"].set_registered_model_alias("ridge", "champion", "1")
    assert state == "success", tasks
    run_key = sanitize_run_key(run_id)

    manifest = committed_manifest(str(home / "stage" / "ridge" / run_key))
    assert manifest["counts"] == {"input_rows": 5000, "output_rows": 5000, "error_rows": 0}
    assert manifest["model"]["sha256"] == registry.get("ridge", "champion").sha256
    out = pq.read_table([f"{manifest['run_dir']}/{f['name']}" for f in manifest["files"]]).sort_by("id")
    assert out.column_names == ["id", "prediction"] and out.schema.field("prediction").type == pa.float64()
    got = out.column("prediction").to_numpy()
    np.testing.assert_allclose(got, logged["models"]["ridge_v1"].predict(frame), atol=ATOL, rtol=0)
    assert np.abs(got - logged["models"]["ridge_v2"].predict(frame)).max() > 0.1  # not the version the alias moved to
