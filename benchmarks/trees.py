"""Traditional models: the provider against the libraries' own loops, in one run.

    flock /tmp/batchinfer-slow.lock python -m benchmarks.trees            # 1M rows x 32 features
    python -m benchmarks.trees --rows 200000 --only onnx                   # quicker

1. **XGBoost** (and LightGBM with ``--only xgboost,lightgbm``), 1M rows x 32 float32 features in
   Parquet, a 200-tree depth-8 model:
   - ``raw``: ``Booster.inplace_predict`` over the whole array, already in memory (the limit);
   - ``stream``: one process, ``ParquetFile.iter_batches`` -> ``inplace_predict`` -> ``ParquetWriter``;
   - ``provider``: ``BatchInferenceOperator.execute()`` as a task runs it (resolve and verify the
     model, ``_job.json``, the runtime on the embedded default, ``_SUCCESS``): the first run after
     the benchmark's start (cold file caches; a one-replica job starts no Ray, and its fresh
     interpreter imports the library), then warm runs (handed to the spare runtime process the run
     before left, its library imported; ``launchers/embedded/warm_runtime.py``).
   ``raw``, ``stream`` and the warm operator run ``REPEATS`` times, interleaved; the table gives each
   one's median and every run's time (one run of a two-second job on two cores moved by 0.1 s).
2. **ONNX vs native scikit-learn** (in-process, same rows, same threads): a logistic regression, an
   MLP and a random forest exported with ``skl2onnx``, scored in model calls of 100 rows and of
   65,536 rows, to say when the ``onnx`` flavor beats the ``sklearn`` one.

Every system runs in its own process (``--child``), so none inherits another's imports or threads.
Each prints one ``BENCH_RESULT {json}`` line; the closing table gives rows/s and ratios from this
run only, with the load average before and after (figures from a busy machine are not comparable).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.idle import wait_for_idle  # noqa: E402
from benchmarks.report import loaded, median_result  # noqa: E402
from benchmarks.workloads import TREE_FEATURES as FEATURES  # noqa: E402
from benchmarks.workloads import log_tree_models, make_tree_data, tree_train_set  # noqa: E402

RESULT_PREFIX = "BENCH_RESULT "
THREADS = 2
REPEATS = 3  # raw, stream and warm operator runs per flavor; the report gives each one's median


def _emit(**result) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --- data and models ------------------------------------------------------------------------------------
def settle_spares(env: dict) -> None:
    from benchmarks.run import settle_spares as settle

    settle(env)


# --- the systems (children) -------------------------------------------------------------------------------
def _load_native(flavor: str, path: str):
    if flavor == "xgboost":
        import xgboost as xgb

        booster = xgb.Booster(model_file=path)
        booster.set_param({"nthread": THREADS})
        return booster.inplace_predict
    import lightgbm as lgb

    booster = lgb.Booster(model_file=path)
    return lambda x: booster.predict(x, num_threads=THREADS)


def raw(cfg: dict) -> None:
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(cfg["files"], columns=FEATURES)
    x = np.column_stack([table.column(c).to_numpy() for c in FEATURES])
    del table
    predict = _load_native(cfg["flavor"], cfg["model_file"])
    t0 = time.monotonic()
    y = predict(x)
    wall = time.monotonic() - t0
    assert len(y) == len(x)
    _emit(rows=len(x), wall_s=wall)


def stream(cfg: dict) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.monotonic()
    predict = _load_native(cfg["flavor"], cfg["model_file"])
    out = Path(cfg["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    writer, rows = None, 0
    for path in cfg["files"]:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=65536, columns=["id", *FEATURES]):
            x = np.column_stack([batch.column(c).to_numpy() for c in FEATURES])
            t = pa.table({"id": batch.column("id"), "prediction": predict(x)})
            if writer is None:
                writer = pq.ParquetWriter(str(out / "part-0.parquet"), t.schema)
            writer.write_table(t)
            rows += t.num_rows
    assert writer is not None
    writer.close()
    _emit(rows=rows, wall_s=time.monotonic() - t0)


def provider(cfg: dict) -> None:
    from types import SimpleNamespace

    os.environ["AIRFLOW_CONN_BATCHINFER_DEFAULT"] = json.dumps(
        {"conn_type": "batchinfer", "extra": {"stage_root": cfg["stage_root"], "registry_root": cfg["registry_root"]}}
    )
    from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec, SaveMode
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    op = BatchInferenceOperator(
        task_id="bench",
        model=cfg["model_name"],
        version="v1",
        input=cfg["input_dir"],
        output_spec=OutputSpec(stage_location=cfg["out_dir"], mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(replicas=1, max_batch_rows=65536),
    )
    ti = SimpleNamespace(dag_id="benchmark", task_id="bench", run_id=f"bench-{os.getpid()}", try_number=1, map_index=-1)
    t0 = time.monotonic()
    xcom = op.execute({"ti": ti})
    wall = time.monotonic() - t0
    manifest = read_valid_manifest(cfg["out_dir"])
    assert manifest is not None, f"no _SUCCESS in {cfg['out_dir']}"
    _emit(rows=xcom["rows"], wall_s=wall, timings=dict(manifest.timings))


def onnx_vs_sklearn(cfg: dict) -> None:
    """Native sklearn ``predict_proba`` vs ONNX Runtime on the same rows, same threads."""
    import numpy as np
    import onnxruntime as ort
    from skl2onnx import to_onnx
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from threadpoolctl import threadpool_limits

    from airflow_provider_batchinfer.runtime.model.ort import ort_session

    threadpool_limits(THREADS)
    x_train, y = tree_train_set(50_000)
    x = np.random.default_rng(9).standard_normal((cfg["rows"], len(FEATURES)), dtype=np.float32)
    models = {
        "logistic_regression": LogisticRegression(max_iter=300),
        "mlp_64_32": MLPClassifier(hidden_layer_sizes=(64, 32), max_iter=30, random_state=0),
        "random_forest_100x10": RandomForestClassifier(n_estimators=100, max_depth=10, n_jobs=THREADS, random_state=0),
    }
    tmp = Path(cfg["out_dir"])
    tmp.mkdir(parents=True, exist_ok=True)
    for name, model in models.items():
        model.fit(x_train.to_numpy(), y)
        path = tmp / f"{name}.onnx"
        path.write_bytes(to_onnx(model, x[:1], options={"zipmap": False}).SerializeToString())
        session = ort_session(path, intra_op_threads=THREADS)
        assert isinstance(session, ort.InferenceSession)
        feed = session.get_inputs()[0].name
        for batch in (100, 65536):
            rows = min(len(x), batch * 200) if batch == 100 else len(x)
            t0 = time.monotonic()
            for a in range(0, rows, batch):
                model.predict_proba(x[a : a + batch])
            native = time.monotonic() - t0
            t0 = time.monotonic()
            for a in range(0, rows, batch):
                session.run(["probabilities"], {feed: x[a : a + batch]})
            onnx_s = time.monotonic() - t0
            check = np.abs(session.run(["probabilities"], {feed: x[:1000]})[0] - model.predict_proba(x[:1000])).max()
            _emit(
                model=name,
                batch=batch,
                rows=rows,
                sklearn_rows_per_s=rows / native,
                onnx_rows_per_s=rows / onnx_s,
                onnx_over_sklearn=native / onnx_s,
                max_abs_diff=float(check),
            )


CHILDREN = {"raw": raw, "stream": stream, "provider": provider, "onnx": onnx_vs_sklearn}


# --- the parent -----------------------------------------------------------------------------------------------
def run_child(cfg: dict, workdir: Path, env: dict, timeout: float = 1800) -> list[dict]:
    spec = workdir / f"cfg-{cfg['system']}-{cfg.get('flavor', '')}-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps(cfg))
    settle_spares(env)  # a spare's imports never run beside a timed system
    settled_s = wait_for_idle()  # nor the previous system's tail (benchmarks/idle.py)
    load_before = os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.trees", "--child", str(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = [
        json.loads(line[len(RESULT_PREFIX) :]) for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)
    ]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{cfg['system']} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    shutil.rmtree(cfg.get("out_dir", workdir / "none"), ignore_errors=True)
    return [
        dict(r, system=cfg["system"], flavor=cfg.get("flavor"), settled_s=settled_s, load_before=round(load_before, 2))
        for r in results
    ]


def _env(workdir: Path) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            "RAY_USAGE_STATS_ENABLED": "0",
            "AIRFLOW_HOME": str(workdir / "airflow"),
            "BATCHINFER_HOME": str(workdir / "home"),
            "BATCHINFER_RAY_DIR": tempfile.mkdtemp(prefix="bir-t-", dir="/tmp"),
        }
    )
    return env


def trees(flavors: list[str], rows: int, workdir: Path, env: dict, repeats: int = REPEATS) -> list[dict]:
    """Every system ``repeats`` times, interleaved (raw, stream, warm operator; the cold operator once,
    the first operator run); one result per run, tagged with its label and repetition."""
    data = make_tree_data(workdir / "stage" / "input", rows)
    files = sorted(map(str, data.glob("*.parquet")))
    model_files = log_tree_models(workdir / "registry", flavors, THREADS)
    results = []
    for flavor in flavors:
        base = {
            "flavor": flavor,
            "files": files,
            "model_file": model_files[flavor],
            "input_dir": str(data),
            "stage_root": str(workdir / "stage"),
            "registry_root": str(workdir / "registry"),
            "model_name": {"xgboost": "bench_xgb", "lightgbm": "bench_lgb"}[flavor],
        }
        for rep in range(repeats):
            runs = (
                ("raw", "raw"),
                ("stream", "stream"),
                *((("provider", "cold"),) if rep == 0 else ()),
                ("provider", "warm"),
            )
            for system, label in runs:
                out = str(workdir / "out" / f"{flavor}-{system}-{label}")
                (result,) = run_child(dict(base, system=system, out_dir=out), workdir, env)
                result.update(label=label, rep=rep)
                results.append(result)
                print(f"   {flavor:8s} {system:8s} {label:5s} {result['wall_s']:8.2f}s", flush=True)
    return results


def medians(tree_results: list[dict], flavor: str) -> dict[str, dict]:
    """``{label: report.median_result of that label's runs}`` for one flavor."""
    out = {}
    for label in ("raw", "stream", "cold", "warm"):
        runs = [r for r in tree_results if r["flavor"] == flavor and r["label"] == label]
        if runs:
            out[label] = median_result(runs)
    return out


def report(tree_results: list[dict], onnx_results: list[dict], load_before: str, load_after: str) -> str:
    lines = [f"load average before: {load_before}", f"load average after:  {load_after}", ""]
    for flavor in sorted({r["flavor"] for r in tree_results}):
        rs = medians(tree_results, flavor)
        raw_rate = rs["raw"]["rows"] / rs["raw"]["wall_s"]
        stream_rate = rs["stream"]["rows"] / rs["stream"]["wall_s"]
        lines.append(f"{flavor}: {rs['raw']['rows']:,} rows x {len(FEATURES)} features")
        lines.append(
            f"  {'system':22s} {'wall s':>8s} {'rows/s':>11s} {'x raw':>7s} {'x stream':>9s} {'load':>5s}  runs (s)"
        )
        for label, name in (
            ("raw", "inplace_predict"),
            ("stream", "streaming loop"),
            ("cold", "operator (first run)"),
            ("warm", "operator (warm)"),
        ):
            r = rs[label]
            rate = r["rows"] / r["wall_s"]
            lines.append(
                f"  {name:22s} {r['wall_s']:8.2f} {rate:11,.0f} {rate / raw_rate:7.3f} {rate / stream_rate:9.3f}"
                f" {r.get('load_before_max', r['load_before']):5.2f}  {', '.join(f'{w:.2f}' for w in sorted(r.get('wall_s_all', [r['wall_s']])))}"
            )
        warm_ratio = (rs["warm"]["rows"] / rs["warm"]["wall_s"]) / raw_rate
        verdict = "holds" if warm_ratio >= 0.8 else "MISSES"
        if loaded(rs["raw"], rs["warm"]):
            busy = max(r.get("load_before_max", r["load_before"]) for r in (rs["raw"], rs["warm"]))
            verdict = f"NOT MEASURED (load {busy:.2f} above {os.cpu_count()} cores; would read {verdict.lower()})"
        lines.append(
            f"  [{verdict}] {flavor} operator (warm) / inplace_predict in memory: {warm_ratio:.3f} (target >= 0.8)"
        )
        timings = rs["warm"].get("timings", {})
        lines.append(
            f"  warm operator's job: total {timings.get('total_s')} s, pipeline {timings.get('pipeline_s')} s, steady {timings.get('steady_rows_per_s')} rows/s"
        )
    if onnx_results:
        lines += ["", f"ONNX Runtime vs native scikit-learn (predict_proba, {THREADS} threads)"]
        lines.append(
            f"  {'model':22s} {'batch':>6s} {'sklearn rows/s':>15s} {'onnx rows/s':>12s} {'onnx/sk':>8s} {'max |diff|':>11s}"
        )
        for r in onnx_results:
            lines.append(
                f"  {r['model']:22s} {r['batch']:6d} {r['sklearn_rows_per_s']:15,.0f} {r['onnx_rows_per_s']:12,.0f} "
                f"{r['onnx_over_sklearn']:8.2f} {r['max_abs_diff']:11.2e}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--onnx-rows", type=int, default=200_000)
    parser.add_argument("--only", default="xgboost,onnx", help="comma list of xgboost, lightgbm, onnx")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--child")
    args = parser.parse_args(argv)
    if args.child:
        cfg = json.loads(Path(args.child).read_text())
        CHILDREN[cfg["system"]](cfg)
        return 0
    only = args.only.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="batchinfer-trees-"))
    env = _env(workdir)
    load_before = Path("/proc/loadavg").read_text().strip()
    print(f"== trees benchmark: {os.cpu_count()} CPU(s); load average {load_before}", flush=True)
    tree_results, onnx_results = [], []
    try:
        flavors = [f for f in ("xgboost", "lightgbm") if f in only]
        if flavors:
            tree_results = trees(flavors, args.rows, workdir, env)
        if "onnx" in only:
            onnx_results = run_child(
                {"system": "onnx", "rows": args.onnx_rows, "out_dir": str(workdir / "onnx")}, workdir, env
            )
    finally:
        from airflow_provider_batchinfer.launchers.embedded.embedded_ray import shutdown

        shutdown(Path(env["BATCHINFER_RAY_DIR"]))
        shutil.rmtree(env["BATCHINFER_RAY_DIR"], ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(tree_results, onnx_results, load_before, Path("/proc/loadavg").read_text().strip())
    print("\n" + text)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "trees.log").write_text(text + "\n")
    (results / "trees.json").write_text(json.dumps({"trees": tree_results, "onnx": onnx_results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
