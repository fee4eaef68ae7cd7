"""Traditional models: ``sklearn`` (skops, or a pickle with ``trust_pickle``), ``xgboost``,
``lightgbm`` and ``onnx``.

Every model is trained in-process on synthetic data. Each flavor runs once end to end through
``dag.test()`` on the session's Ray (3,000 rows, one module-scoped registry), and its predictions
must equal the model's own ``predict`` on the same rows: exactly for scikit-learn and the trees,
within 1e-5 for the ONNX float model. The bad inputs (a missing feature, a wrong dtype, a model file
changed after logging, an untrusted type in a skops file) go through the runtime's own checks
before Ray starts (``driver.check_before_ray``), and one of them through a whole ``dag.test()``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.base import BaseEstimator, TransformerMixin

from airflow_provider_batchinfer.registry import (
    MODEL_MANIFEST,
    ModelRegistry,
    RegistryError,
    TamperedModelError,
    hash_tree,
    verify_local_copy,
)
from airflow_provider_batchinfer.registry.digest import version_digest
from airflow_provider_batchinfer.registry.tabular import UntrustedModelError
from airflow_provider_batchinfer.runtime.driver import check_before_ray
from airflow_provider_batchinfer.runtime.errors import BadRowError, check_batch
from airflow_provider_batchinfer.runtime.model.flavors import load_predictor
from airflow_provider_batchinfer.store.inputs import InputError
from tests.models import job_file

ROWS = 3000
NUMERIC = ["zeta", "alpha", "mid", "beta", "omega"]  # not alphabetical: the order must survive the registry
FEATURES = [*NUMERIC, "gap", "color"]  # gap: NaN in every 7th row; color: a categorical (strings)


class Clip(BaseEstimator, TransformerMixin):
    """A user's own transformer: a type skops does not trust unless someone says so."""

    def fit(self, X, y=None):
        return self

    def transform(self, X):
        return np.clip(X, -3, 3)


def make_data(rows: int = ROWS, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({name: rng.normal(size=rows) for name in NUMERIC})
    df["gap"] = np.where(np.arange(rows) % 7 == 0, np.nan, rng.normal(size=rows))
    df["color"] = rng.choice(["red", "green", "blue"], rows)
    df.insert(0, "row_id", np.arange(rows, dtype=np.int64))
    return df


def target(df: pd.DataFrame) -> np.ndarray:
    score = df["zeta"] - 0.5 * df["alpha"] + (df["color"] == "green") + df["gap"].fillna(0) * 0.3
    return np.digitize(score, [-0.5, 0.7])  # three classes


def write_input(df: pd.DataFrame, directory: Path, files: int = 3) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(df, preserve_index=False)
    per = -(-len(df) // files)
    for n, start in enumerate(range(0, len(df), per)):
        pq.write_table(table.slice(start, per), directory / f"part-{n}.parquet")
    return directory


def sklearn_pipeline(df: pd.DataFrame, clip: bool = False):
    from sklearn.compose import ColumnTransformer
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline, make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    numeric = [SimpleImputer(), StandardScaler(), *([Clip()] if clip else [])]
    prep = ColumnTransformer([("num", make_pipeline(*numeric), [*NUMERIC, "gap"]), ("cat", OneHotEncoder(), ["color"])])
    return Pipeline([("prep", prep), ("clf", LogisticRegression(max_iter=500))]).fit(df[FEATURES], target(df))


def tree_frame(df: pd.DataFrame) -> pd.DataFrame:
    out = df[FEATURES].copy()
    out["color"] = out["color"].astype("category")
    return out


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    """Data, models and one registry for the module: {name: (model, ModelVersion)}, the input."""
    import lightgbm as lgb
    import xgboost as xgb
    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    home = tmp_path_factory.mktemp("tabular") / "batchinfer"
    registry = ModelRegistry(str(home / "registry"))
    df = make_data()
    y = target(df)
    pipe = sklearn_pipeline(df)
    xgb_model = xgb.XGBClassifier(n_estimators=30, max_depth=4, enable_categorical=True, tree_method="hist")
    xgb_model.fit(tree_frame(df), y)
    lgb_model = lgb.LGBMClassifier(n_estimators=30, num_leaves=15, verbose=-1).fit(tree_frame(df), y)
    mlp = make_pipeline(StandardScaler(), MLPRegressor(hidden_layer_sizes=(16,), max_iter=300, random_state=0))
    mlp.fit(df[NUMERIC].to_numpy(np.float32), df["zeta"] * 2 + df["mid"] ** 2)
    onx = to_onnx(mlp, df[NUMERIC].to_numpy(np.float32)[:5])
    models = {
        "sklearn": (
            pipe,
            registry.log_model(
                "churn_sk", "v1", "sklearn", pipe, method=["predict", "predict_proba"], input_example=df[FEATURES][:5]
            ),
        ),
        "xgboost": (xgb_model, registry.log_model("churn_xgb", "v1", "xgboost", xgb_model, method="predict")),
        "lightgbm": (
            lgb_model,
            registry.log_model(
                "churn_lgb", "v1", "lightgbm", lgb_model, method=["predict", "predict_proba"], proba="list"
            ),
        ),
        "onnx": (onx, registry.log_model("spend_onnx", "v1", "onnx", onx, feature_names=NUMERIC)),
    }
    return {"home": home, "registry": registry, "df": df, "models": models, "input": write_input(df, home / "input")}


# --- logging: what each flavor stores and infers --------------------------------------------------------


def test_each_flavor_infers_its_signature_and_stores_a_safe_format(tabular):
    models = tabular["models"]
    sk = models["sklearn"][1]
    assert list(json.loads((Path(sk.uri) / "artifact" / "flavor.json").read_text())["features"]) == FEATURES
    assert sk.signature["inputs"] == {**dict.fromkeys([*NUMERIC, "gap"], "float64"), "color": "string"}
    assert set(sk.signature["outputs"]) == {"prediction", "proba_0", "proba_1", "proba_2"}
    files = {name: sorted(hash_tree(Path(mv.uri))) for name, (_, mv) in models.items()}
    assert files == {
        "sklearn": ["artifact/flavor.json", "artifact/model.skops"],
        "xgboost": ["artifact/flavor.json", "artifact/model.ubj"],
        "lightgbm": ["artifact/flavor.json", "artifact/model.txt"],
        "onnx": ["artifact/flavor.json", "artifact/model.onnx"],
    }
    xgb_sig = models["xgboost"][1].signature
    assert xgb_sig["inputs"] == {**dict.fromkeys([*NUMERIC, "gap"], "number"), "color": "category"}
    assert xgb_sig["outputs"] == {"prediction": "int64"}
    assert models["lightgbm"][1].signature["inputs"]["color"] == "category"
    assert models["lightgbm"][1].signature["outputs"] == {"prediction": "int64", "probabilities": "list<float64>"}
    assert models["onnx"][1].signature["inputs"] == dict.fromkeys(NUMERIC, "float32")
    # the skops file's own types are the trusted list, recorded in the hashed flavor.json
    settings = json.loads((Path(sk.uri) / "artifact" / "flavor.json").read_text())
    assert settings["format"] == "skops" and not settings["trust_pickle"]
    import skops.io as sio

    assert settings["trusted_types"] == sorted(sio.get_untrusted_types(file=Path(sk.uri) / "artifact/model.skops"))
    # the same model logs to the same bytes: a content-addressed version is reused, not duplicated
    registry = tabular["registry"]
    first = registry.log_model("again", None, "sklearn", models["sklearn"][0])
    assert registry.log_model("again", None, "sklearn", models["sklearn"][0], if_exists="reuse") == first


def test_a_pickle_is_refused_without_trust_pickle_and_flagged_with_it(tabular, tmp_path, capsys):
    import joblib

    pipe = tabular["models"]["sklearn"][0]
    registry = ModelRegistry(str(tmp_path / "registry"))
    joblib.dump(pipe, tmp_path / "model.joblib")
    with pytest.raises(UntrustedModelError, match="is a pickle.*trust_pickle=True"):
        registry.log_model("p", "v1", "sklearn", str(tmp_path / "model.joblib"))
    assert registry.list_versions("p") == []
    mv = registry.log_model("p", "v1", "sklearn", str(tmp_path / "model.joblib"), trust_pickle=True)
    manifest = registry.read_manifest("p", "v1")
    assert manifest["options"]["trust_pickle"] is True and manifest["options"]["format"] == "joblib"
    # the job log says so before Ray starts, and the replica's predictor equals the pipeline
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    check_before_ray(job_file(run_dir, mv, registry.root, [tabular["input"]]))
    assert "is a pickle (joblib), loaded because it was logged with trust_pickle=True" in capsys.readouterr().out
    predict = load_predictor(Path(mv.uri), verify_local_copy(Path(mv.uri)), "cpu", 1, max_rows=500)
    df = tabular["df"][:700]
    out = predict(pa.Table.from_pandas(df[FEATURES], preserve_index=False), {})
    np.testing.assert_array_equal(out["prediction"], pipe.predict(df[FEATURES]))
    # a pickle whose manifest lost the flag is refused (the flag is needed in both places)
    manifest["options"].pop("trust_pickle")
    (Path(mv.uri) / MODEL_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UntrustedModelError, match="not logged with trust_pickle=True"):
        load_predictor(Path(mv.uri), manifest, "cpu", 1)


def test_log_time_refusals_name_what_to_write(tabular, tmp_path):
    import xgboost as xgb

    registry = ModelRegistry(str(tmp_path / "registry"))
    pipe = tabular["models"]["sklearn"][0]
    with pytest.raises(RegistryError, match=r"accepts .*'trust_pickle'"):
        registry.log_model("m", "v1", "sklearn", pipe, temperature=0.5)
    with pytest.raises(RegistryError, match="do not match the sklearn model's features"):
        registry.log_model("m", "v1", "sklearn", pipe, signature={"inputs": {"a": "number"}, "outputs": {}})
    with pytest.raises(RegistryError, match="method must be one of"):
        registry.log_model("m", "v1", "sklearn", pipe, method="transform")
    booster = xgb.train(
        {"max_depth": 2}, xgb.DMatrix(np.random.default_rng(0).normal(size=(50, 3)), label=np.ones(50)), 2
    )
    with pytest.raises(RegistryError, match=r"fitted without feature names: pass feature_names=\[...\]"):
        registry.log_model("m", "v1", "xgboost", booster)
    with pytest.raises(RegistryError, match="feature_names has 2 names but the xgboost booster takes 3"):
        registry.log_model("m", "v1", "xgboost", booster, feature_names=["a", "b"])
    mv = registry.log_model("m", "v1", "xgboost", booster, feature_names=["c", "a", "b"], format="json")
    assert list(json.loads((Path(mv.uri) / "artifact/flavor.json").read_text())["features"]) == ["c", "a", "b"]
    assert "artifact/model.json" in registry.read_manifest("m", "v1")["files"]
    assert registry.list_versions("m") == ["v1"]


def test_a_bare_xgboost_booster_scores_float64_columns_exactly_as_its_own_inplace_predict(tmp_path):
    """The flavor hands XGBoost a float32 matrix (XGBoost casts every value to float32 itself): the
    predictions are bit for bit those of ``inplace_predict`` on the float64 columns, NaN included,
    over several 16,384-row calls."""
    import xgboost as xgb

    rng = np.random.default_rng(7)
    x = rng.normal(size=(40_000, 3)) * 1e3
    x[::11, 1] = np.nan
    booster = xgb.train({"max_depth": 6, "nthread": 1}, xgb.DMatrix(x, label=x[:, 0] > 0), 20)
    mv = ModelRegistry(str(tmp_path / "registry")).log_model(
        "b", "v1", "xgboost", booster, feature_names=["c", "a", "b"]
    )
    manifest = json.loads((Path(mv.uri) / MODEL_MANIFEST).read_text())
    predict = load_predictor(Path(mv.uri), manifest, "cpu", 1, max_rows=16384)
    table = pa.table({"a": x[:, 1], "b": x[:, 2], "c": x[:, 0]})  # not in the model's order
    np.testing.assert_array_equal(predict(table, {})["prediction"], booster.inplace_predict(x))


def test_an_xgboost_wrapper_scores_arrow_columns_with_nulls_exactly_as_its_own_predict(tmp_path):
    """Numeric features reach XGBoost as one float32 matrix: a null is missing, as NaN is, and
    labels and probabilities are bit for bit the wrapper's own on the float matrix with NaN,
    whatever the column types (int64, float64, bool, float32)."""
    import xgboost as xgb

    rng = np.random.default_rng(11)
    rows = 20_000
    x = np.column_stack(
        [rng.integers(0, 50, rows), rng.normal(size=rows) * 1e3, rng.random(rows) > 0.5, rng.normal(size=rows)]
    ).astype(np.float64)
    y = ((x[:, 0] > 25) ^ (x[:, 2] > 0)).astype(int)
    model = xgb.XGBClassifier(n_estimators=20, max_depth=4, tree_method="hist", n_jobs=1)
    model.fit(pd.DataFrame(x, columns=["n", "amount", "flag", "z"]), y)
    mv = ModelRegistry(str(tmp_path / "registry")).log_model("w", "v1", "xgboost", model)
    manifest = json.loads((Path(mv.uri) / MODEL_MANIFEST).read_text())
    predict = load_predictor(Path(mv.uri), manifest, "cpu", 1, max_rows=16384)
    nulls = np.zeros(rows, dtype=bool)
    nulls[::7] = True
    table = pa.table(
        {
            "amount": pa.array(x[:, 1], mask=nulls),
            "flag": pa.array(x[:, 2] > 0),
            "n": pa.array(x[:, 0].astype(np.int64)),
            "z": pa.array(x[:, 3].astype(np.float32)),
        }
    )
    got = predict(table, {})
    x[nulls, 1] = np.nan
    x[:, 3] = x[:, 3].astype(np.float32)
    np.testing.assert_array_equal(got["prediction"], model.predict(x))
    assert got["prediction"].dtype == model.predict(x).dtype


# --- bad inputs: each fails before any compute, naming the column or type -------------------------------


def _checked(tabular, flavor: str, df: pd.DataFrame, tmp_path: Path, registry: ModelRegistry | None = None):
    registry = registry or tabular["registry"]
    mv = registry.get(tabular["models"][flavor][1].name, "v1")
    inputs = write_input(df, tmp_path / "bad-input", files=1)
    run_dir = tmp_path / "out"
    run_dir.mkdir(exist_ok=True)
    return run_dir, job_file(run_dir, mv, registry.root, [inputs])


@pytest.mark.parametrize("flavor", ["sklearn", "xgboost", "lightgbm", "onnx"])
def test_a_missing_feature_fails_before_any_compute(tabular, tmp_path, flavor):
    run_dir, job = _checked(tabular, flavor, tabular["df"][:50].drop(columns=["mid"]), tmp_path)
    with pytest.raises(InputError, match=r"model input 'mid' needs column 'mid', which the input .* does not have"):
        check_before_ray(job)
    assert list(run_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("flavor", "column", "expected"),
    [
        ("sklearn", "alpha", "float64"),
        ("xgboost", "beta", "number"),
        ("lightgbm", "omega", "number"),
        ("onnx", "zeta", "float32"),
    ],
)
def test_a_wrong_dtype_fails_before_any_compute(tabular, tmp_path, flavor, column, expected):
    df = tabular["df"][:50].copy()
    df[column] = df[column].astype(str)
    run_dir, job = _checked(tabular, flavor, df, tmp_path)
    with pytest.raises(
        InputError, match=rf"column '{column}' of .* is (large_)?string, but model input '{column}' expects {expected}"
    ):
        check_before_ray(job)
    assert list(run_dir.iterdir()) == []


def test_a_category_given_as_floats_is_refused(tabular, tmp_path):
    df = tabular["df"][:50].copy()
    df["color"] = 1.5
    _, job = _checked(tabular, "lightgbm", df, tmp_path)
    with pytest.raises(InputError, match="column 'color' of .* is double, but model input 'color' expects category"):
        check_before_ray(job)


@pytest.mark.parametrize("flavor", ["sklearn", "xgboost", "lightgbm", "onnx"])
def test_a_model_file_changed_after_logging_fails_before_any_compute(tabular, tmp_path, flavor):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    mv = tabular["models"][flavor][1]
    registry = ModelRegistry(str(tmp_path / "registry"))
    shutil.copytree(mv.uri, tmp_path / "registry" / mv.name / "v1")
    model_file = next(
        p for p in (tmp_path / "registry" / mv.name / "v1" / "artifact").iterdir() if p.name != "flavor.json"
    )
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    model_file.write_bytes(bytes(data))
    run_dir, job = _checked(tabular, flavor, tabular["df"][:50], tmp_path, registry)
    with pytest.raises(TamperedModelError, match=rf"model file .*{model_file.name} does not match its recorded sha256"):
        check_before_ray(job)
    assert list(run_dir.iterdir()) == []
    # the Airflow side refuses it first, when it resolves the version
    hook = ModelServiceHook()
    hook.__dict__["registry"] = registry
    with pytest.raises(TamperedModelError, match=model_file.name):
        hook.get_model(mv.name, "v1")


def test_an_untrusted_type_in_a_skops_file_is_refused_at_log_and_at_load(tabular, tmp_path):
    import skops.io as sio

    df = tabular["df"]
    clipped = sklearn_pipeline(df, clip=True)
    sio.dump(clipped, tmp_path / "clipped.skops")
    registry = ModelRegistry(str(tmp_path / "registry"))
    with pytest.raises(
        UntrustedModelError, match=r"holds types that are not trusted: .*tests.e2e.test_flavors_tabular.Clip"
    ):
        registry.log_model("clip", "v1", "sklearn", str(tmp_path / "clipped.skops"))
    assert registry.list_versions("clip") == []
    # named as trusted, it logs; logged as an object, its own types are trusted
    trusted = sio.get_untrusted_types(file=tmp_path / "clipped.skops")
    assert "tests.e2e.test_flavors_tabular.Clip" in trusted
    registry.log_model("clip", "v1", "sklearn", str(tmp_path / "clipped.skops"), trusted_types=trusted)
    # a version whose skops file was swapped for one with a type nobody trusted (its MODEL.json re-hashed
    # to match, as a registry writer could): the runtime refuses before Ray starts, naming the type
    shutil.copytree(tabular["models"]["sklearn"][1].uri, tmp_path / "registry" / "churn_sk" / "v1")
    version = tmp_path / "registry" / "churn_sk" / "v1"
    shutil.copyfile(tmp_path / "clipped.skops", version / "artifact" / "model.skops")
    manifest = json.loads((version / MODEL_MANIFEST).read_text())
    manifest["files"] = hash_tree(version)
    manifest["sha256"] = version_digest(manifest)
    (version / MODEL_MANIFEST).write_text(json.dumps(manifest))
    run_dir, job = _checked(tabular, "sklearn", df[:50], tmp_path, registry)
    with pytest.raises(
        UntrustedModelError,
        match=r"not trusted when model churn_sk/v1 was logged: .*tests.e2e.test_flavors_tabular.Clip",
    ):
        check_before_ray(job)
    assert list(run_dir.iterdir()) == []
    with pytest.raises(UntrustedModelError, match="tests.e2e.test_flavors_tabular.Clip"):
        load_predictor(version, manifest, "cpu", 1)  # and every replica, before it loads


def test_trees_take_missing_values_and_other_flavors_refuse_them(tabular):
    batch = pa.table({"gap": pa.array([1.0, float("nan"), None])})
    check_batch(batch, ["gap"], None, None, missing_ok=["gap"])
    with pytest.raises(BadRowError, match="column 'gap' has 1 null value"):
        check_batch(batch, ["gap"], None, None)


def test_categories_map_by_name_whatever_the_order_in_the_input(tabular):
    """XGBoost and LightGBM map category names to their training codes: a batch whose dictionary
    lists the colors in another order (or that holds plain strings) scores the same."""
    df = tabular["df"][:400]
    expected = {f: tabular["models"][f][0].predict(tree_frame(df)) for f in ("xgboost", "lightgbm")}
    table = pa.Table.from_pandas(df[FEATURES], preserve_index=False)
    reordered = table.set_column(
        FEATURES.index("color"),
        "color",
        pa.DictionaryArray.from_arrays(
            pa.array([["blue", "red", "green"].index(c) for c in df["color"]], pa.int8()), ["blue", "red", "green"]
        ),
    )
    for flavor, want in expected.items():
        mv = tabular["models"][flavor][1]
        predict = load_predictor(Path(mv.uri), verify_local_copy(Path(mv.uri)), "cpu", 1, max_rows=150)
        for batch in (table, reordered, table.select(list(reversed(FEATURES)))):
            np.testing.assert_array_equal(predict(batch, {})["prediction"], want)


# --- end to end: dag.test() on the session's Ray ----------------------------------------------------------


def _expected(tabular, flavor: str) -> dict[str, np.ndarray]:
    model, df = tabular["models"][flavor][0], tabular["df"]
    if flavor == "sklearn":
        proba = model.predict_proba(df[FEATURES])
        return {"prediction": model.predict(df[FEATURES]), **{f"proba_{k}": proba[:, k] for k in range(3)}}
    if flavor == "xgboost":
        return {"prediction": model.predict(tree_frame(df))}
    if flavor == "lightgbm":
        return {"prediction": model.predict(tree_frame(df)), "probabilities": model.predict_proba(tree_frame(df))}
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: df[NUMERIC].to_numpy(np.float32)})
    return {"variable": out[:, 0]}


@pytest.mark.usefixtures("airflow_db", "ray_cluster")
@pytest.mark.parametrize("flavor", ["sklearn", "xgboost", "lightgbm", "onnx"])
def test_each_flavor_scores_end_to_end_like_the_models_own_predict(tabular, tmp_path, monkeypatch, flavor):
    from tests.conftest import run_dag
    from tests.models import committed_manifest

    monkeypatch.setenv("BATCHINFER_HOME", str(tabular["home"]))
    mv = tabular["models"][flavor][1]
    out = tmp_path / "out"
    state, tasks, _ = run_dag(
        "bi_test_error_mode", model=mv.name, version="v1", input=str(tabular["input"]), out=str(out)
    )
    assert state == "success", tasks
    manifest = committed_manifest(str(out))
    assert manifest["counts"] == {"input_rows": ROWS, "output_rows": ROWS, "error_rows": 0}
    assert manifest["model"]["flavor"] == flavor and manifest["model"]["sha256"] == mv.sha256
    table = pq.read_table([str(out / f["name"]) for f in manifest["files"]]).sort_by("row_id")
    assert table.column("row_id").to_pylist() == list(range(ROWS))
    for name, want in _expected(tabular, flavor).items():
        got = table.column(name).to_pylist()
        if flavor == "onnx":
            np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
        else:  # trees and scikit-learn: exactly
            np.testing.assert_array_equal(np.asarray(got), want)
    # what is not a model input passes through untouched
    passthrough = set(table.column_names) - set(mv.signature["outputs"])
    assert "row_id" in passthrough and not passthrough & set(mv.signature["inputs"])


@pytest.mark.usefixtures("airflow_db")
def test_a_missing_feature_fails_the_task_before_ray_and_commits_nothing(tabular, tmp_path, monkeypatch, capfd):
    from tests.conftest import run_dag

    monkeypatch.setenv("BATCHINFER_HOME", str(tabular["home"]))
    inputs = write_input(tabular["df"][:100].drop(columns=["gap"]), tmp_path / "in", files=1)
    out = tmp_path / "out"
    state, tasks, _ = run_dag("bi_test_error_mode", model="churn_xgb", version="v1", input=str(inputs), out=str(out))
    assert state == "failed" and tasks["infer"][0] == "failed"
    assert "model input 'gap' needs column 'gap'" in capfd.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.name != "_claims") == ["_job.json"]  # no parts, no _SUCCESS
