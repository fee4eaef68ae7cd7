"""The systems the benchmark compares, one per process: ``python -m benchmarks.systems <config.json>``.

Each run prints one ``BENCH_RESULT {json}`` line with what it measured itself (wall seconds of
the measured section, rows); the parent (``benchmarks/run.py``) samples the peak RSS of the
process tree from outside. Systems:

- ``raw``: the model's own loop over in-memory data in this one process (the limit);
- ``stream``: a single-process streaming loop without Ray (ParquetFile.iter_batches -> model ->
  ParquetWriter), tabular only;
- ``plain_ray``: Ray Data as a user writes it (read_parquet -> map_batches(actor class) ->
  write_parquet), on a fresh local Ray;
- ``provider``: BatchInferenceOperator.execute() as a task runs it: resolve and verify the model,
  write ``_job.json``, launch the runtime with the local launcher, wait for ``_SUCCESS``;
- ``provider_pool``: the same with ``JobSpec(in_driver_max_rows=0)``: on Ray Data's actor pool, as on
  a named cluster, instead of in the driver process (what a one-replica job on the embedded Ray gets);
- ``provider_int8``: the same with ``JobSpec(backend="onnx_int8")`` (text only);
- ``provider_onnx``: the same with ``JobSpec(backend="onnx")`` (the MLP on ONNX Runtime, no torch).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

RESULT_PREFIX = "BENCH_RESULT "


def _emit(**result) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _texts(files: list[str]) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(files, columns=["text"]).column("text").to_pylist()


# --- (1) raw: the model's own loop over in-memory data ------------------------------------------------
def raw_text(cfg: dict) -> None:
    from sentence_transformers import SentenceTransformer

    texts = _texts(cfg["files"])
    t0 = time.monotonic()
    model = SentenceTransformer(cfg["st_dir"], device="cpu", local_files_only=True)
    t1 = time.monotonic()
    emb = model.encode(texts, show_progress_bar=False, convert_to_numpy=True)
    t2 = time.monotonic()
    assert emb.shape[0] == len(texts)
    _emit(rows=len(texts), wall_s=t2 - t1, load_s=t1 - t0)


def raw_mlp(cfg: dict) -> None:
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    table = pq.read_table(cfg["files"], columns=cfg["features"])
    x = torch.from_numpy(np.column_stack([table.column(c).to_numpy() for c in cfg["features"]]).astype(np.float32))
    del table
    t0 = time.monotonic()
    model = torch.jit.load(cfg["jit_file"]).eval()
    t1 = time.monotonic()
    chunk = 65536
    outs = []
    with torch.inference_mode():
        for start in range(0, x.shape[0], chunk):
            outs.append(model(x[start : start + chunk]))
    y = torch.cat(outs)
    t2 = time.monotonic()
    assert y.shape[0] == x.shape[0]
    _emit(rows=int(x.shape[0]), wall_s=t2 - t1, load_s=t1 - t0, torch_threads=torch.get_num_threads())


# --- (1b) single-process streaming loop without Ray -----------------------------------------------------
def stream_mlp(cfg: dict) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    t0 = time.monotonic()
    model = torch.jit.load(cfg["jit_file"]).eval()
    out = Path(cfg["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    writer = None
    rows = 0
    with torch.inference_mode():
        for path in cfg["files"]:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=65536, columns=["id", *cfg["features"]]):
                x = np.column_stack([batch.column(c).to_numpy() for c in cfg["features"]]).astype(
                    np.float32, copy=False
                )
                y = model(torch.from_numpy(x)).numpy()[:, 0]
                t = pa.table({"id": batch.column("id"), "score": y})
                if writer is None:
                    writer = pq.ParquetWriter(str(out / "part-0.parquet"), t.schema, compression="zstd")
                writer.write_table(t)
                rows += t.num_rows
    writer.close()
    _emit(rows=rows, wall_s=time.monotonic() - t0)


# --- (2) plain Ray Data, as a user writes it ----------------------------------------------------------------
class _Embedder:
    def __init__(self, st_dir: str):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(st_dir, device="cpu", local_files_only=True)

    def __call__(self, batch):
        return {"ticket_id": batch["ticket_id"], "embedding": self.model.encode(list(batch["text"]))}


class _Scorer:
    def __init__(self, jit_file: str, features: list[str]):
        import torch

        self.model = torch.jit.load(jit_file).eval()
        self.features = features

    def __call__(self, batch):
        import numpy as np
        import torch

        x = torch.from_numpy(np.column_stack([batch[c] for c in self.features]).astype(np.float32))
        with torch.no_grad():
            y = self.model(x).numpy()[:, 0]
        return {"id": batch["id"], "score": y}


def plain_ray(cfg: dict) -> None:
    t0 = time.monotonic()
    import ray
    import ray.data

    ray.init(
        address="local", include_dashboard=False, logging_level="WARNING"
    )  # a fresh local Ray, like the provider's
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.read_parquet(cfg["files"])
    if cfg["workload"] == "text":
        ds = ds.map_batches(_Embedder, fn_constructor_kwargs={"st_dir": cfg["st_dir"]}, concurrency=1)
    else:
        ds = ds.map_batches(
            _Scorer, fn_constructor_kwargs={"jit_file": cfg["jit_file"], "features": cfg["features"]}, concurrency=1
        )
    ds.write_parquet(cfg["out_dir"])
    t1 = time.monotonic()
    ray.shutdown()
    t2 = time.monotonic()
    import pyarrow.parquet as pq

    rows = (
        pq.ParquetDataset(cfg["out_dir"]).count_rows()
        if hasattr(pq.ParquetDataset, "count_rows")
        else pq.read_table(cfg["out_dir"], columns=[]).num_rows
    )
    _emit(rows=rows, wall_s=t2 - t0, pipeline_s=t1 - t0, shutdown_s=t2 - t1)


# --- (3) the provider, end to end ----------------------------------------------------------------------------
def provider(cfg: dict) -> None:
    from types import SimpleNamespace

    os.environ["AIRFLOW_CONN_BATCHINFER_DEFAULT"] = json.dumps(
        {"conn_type": "batchinfer", "extra": {"stage_root": cfg["stage_root"], "registry_root": cfg["registry_root"]}}
    )
    from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode

    op = BatchInferenceOperator(
        task_id="bench",
        model=cfg["model_name"],
        version=cfg["model_version"],
        input=cfg["input_dir"],
        input_spec=InputSpec(),
        output_spec=OutputSpec(stage_location=cfg["out_dir"], mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(
            replicas=cfg.get("replicas", 1),
            backend=cfg.get("backend"),
            in_driver_max_rows=cfg.get("in_driver_max_rows"),
        ),
    )
    ti = SimpleNamespace(dag_id="benchmark", task_id="bench", run_id=f"bench-{os.getpid()}", try_number=1, map_index=-1)
    t0 = time.monotonic()
    xcom = op.execute({"ti": ti})
    wall = time.monotonic() - t0
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    manifest = read_valid_manifest(cfg["out_dir"])
    assert manifest is not None, f"no _SUCCESS in {cfg['out_dir']}"
    _emit(rows=xcom["rows"], wall_s=wall, timings=dict(manifest.timings), replicas=cfg.get("replicas", 1))


SYSTEMS = {
    ("raw", "text"): raw_text,
    ("raw", "mlp"): raw_mlp,
    ("stream", "mlp"): stream_mlp,
    ("plain_ray", "text"): plain_ray,
    ("plain_ray", "mlp"): plain_ray,
    ("provider", "text"): provider,
    ("provider", "mlp"): provider,
    # the same job on Ray Data's actor pool instead of the driver process (runtime/engine/in_driver.py)
    ("provider_pool", "text"): lambda cfg: provider({**cfg, "in_driver_max_rows": 0}),
    ("provider_pool", "mlp"): lambda cfg: provider({**cfg, "in_driver_max_rows": 0}),
    # the optimized backend (ONNX Runtime, INT8 weights), its export made before the timed run
    ("provider_int8", "text"): lambda cfg: provider({**cfg, "backend": "onnx_int8"}),
    # the MLP on ONNX Runtime (JobSpec(backend="onnx")): a job on the cached export never imports torch
    ("provider_onnx", "mlp"): lambda cfg: provider({**cfg, "backend": "onnx"}),
}


def main(argv: list[str]) -> int:
    cfg = json.loads(Path(argv[0]).read_text())
    SYSTEMS[(cfg["system"], cfg["workload"])](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
