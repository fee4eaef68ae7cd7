"""Incremental scoring (``JobSpec(reuse="unchanged")``): wall time of an incremental run ÷ a full run.

    python -m benchmarks.incremental                      # MiniLM 20k texts + torch MLP 1M rows
    python -m benchmarks.incremental --text-rows 5000 --mlp-rows 200000   # quicker

For each workload, on the provider end to end (``BatchInferenceOperator.execute`` as a task runs it,
on this benchmark's own warm embedded Ray):

1. ``day 1`` with reuse on: every row scored, keys written (its wall ÷ the full run below is the
   cost of writing the key index);
2. ``full``: day 2 (2% of the rows changed) with reuse off: what a run costs today;
3. ``incremental``: day 2 with reuse on, under the same base as day 1: only the changed rows scored.

The ratio ``incremental ÷ full`` is the headline figure (target ≤ 0.15 on MiniLM). MiniLM runs
~100-300 rows/s on 2 cores, so its default size is 20k texts (a full run of 1M would take hours);
the MLP runs 1M rows. The load average is printed before and after: on a shared machine, figures are
only comparable when it is low. Results go to ``benchmarks/results/incremental.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.workloads import FEATURES, log_models, make_features, make_mlp, make_texts  # noqa: E402

CHANGED_EVERY = 50  # 2% of the rows


def _changed_texts(src: Path, dst: Path) -> Path:
    """Day 2 of the text workload: every 50th ticket gets a new sentence."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*.parquet")):
        t = pq.read_table(f)
        texts = t.column("text")
        mask = pa.array(t.column("ticket_id").to_numpy() % CHANGED_EVERY == 0)
        new = pc.if_else(mask, pc.binary_join_element_wise(texts, "(updated today)", " "), texts)
        pq.write_table(t.set_column(t.schema.get_field_index("text"), "text", new), dst / f.name)
    return dst


def _changed_features(src: Path, dst: Path) -> Path:
    """Day 2 of the tabular workload: every 50th row gets a new first feature."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*.parquet")):
        t = pq.read_table(f)
        ids = t.column("id").to_numpy()
        first = t.column(FEATURES[0]).to_numpy().copy()
        first[ids % CHANGED_EVERY == 0] += np.float32(1.0)
        column = pa.array(first)
        pq.write_table(t.set_column(t.schema.get_field_index(FEATURES[0]), FEATURES[0], column), dst / f.name)
    return dst


def _run(name: str, version: str, input_dir: Path, base: str, run_id: str, reuse: str | None) -> dict:
    from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    op = BatchInferenceOperator(
        task_id="bench",
        model=name,
        version=version,
        input=str(input_dir),
        input_spec=InputSpec(),
        output_spec=OutputSpec(base_stage_location=base, mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(replicas=1, reuse=reuse),
    )
    ti = SimpleNamespace(dag_id="benchmark", task_id="bench", run_id=run_id, try_number=1, map_index=-1)
    t0 = time.monotonic()
    xcom = op.execute({"ti": ti})
    wall = time.monotonic() - t0
    manifest = read_valid_manifest(xcom["output_location"])
    assert manifest is not None
    reuse_info = manifest.reuse.summary() if manifest.reuse else {}
    out = {"wall_s": round(wall, 2), "rows": xcom["rows"], **reuse_info, "timings": dict(manifest.timings)}
    print(f"   {run_id:12s} reuse={reuse!s:9s} {json.dumps(out)}", flush=True)
    return out


def workload(label: str, model: tuple[str, str], day1: Path, day2: Path, stage: Path) -> dict:
    name, version = model
    first = _run(name, version, day1, str(stage / label / "incremental"), "day1", "unchanged")
    full = _run(name, version, day2, str(stage / label / "full"), "day2", None)
    incremental = _run(name, version, day2, str(stage / label / "incremental"), "day2", "unchanged")
    return {
        "workload": label,
        "rows": full["rows"],
        "changed_fraction": 1 / CHANGED_EVERY,
        "day1_with_keys": first,
        "full": full,
        "incremental": incremental,
        "incremental_over_full": round(incremental["wall_s"] / full["wall_s"], 3),
        "keys_overhead_day1_over_full": round(first["wall_s"] / full["wall_s"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--text-rows", type=int, default=20_000)
    parser.add_argument("--mlp-rows", type=int, default=1_000_000)
    parser.add_argument("--only", choices=["text", "mlp"], action="append")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "incremental.json"))
    args = parser.parse_args(argv)
    only = set(args.only or ["text", "mlp"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the embedded Ray below
    work = Path(tempfile.mkdtemp(prefix="batchinfer-incr-"))
    ray_dir = tempfile.mkdtemp(prefix="bir-i-", dir="/tmp")
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.update(
        {
            "AIRFLOW_HOME": str(work / "airflow"),
            "BATCHINFER_HOME": str(work / "home"),
            "BATCHINFER_RAY_DIR": ray_dir,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "AIRFLOW_CONN_BATCHINFER_DEFAULT": json.dumps(
                {
                    "conn_type": "batchinfer",
                    "extra": {"stage_root": str(work / "stage"), "registry_root": str(work / "registry")},
                }
            ),
        }
    )
    load_before = os.getloadavg()
    print(f"== incremental scoring benchmark, {os.cpu_count()} CPU(s), load average {load_before}", flush=True)
    results = []
    try:
        models = log_models(work / "registry", make_mlp(work / "mlp.pt"))
        if "text" in only:
            print(f"== all-MiniLM-L6-v2, {args.text_rows:,} texts, 2% changed", flush=True)
            day1 = make_texts(work / "in" / "text-day1", args.text_rows)
            day2 = _changed_texts(day1, work / "in" / "text-day2")
            results.append(workload("minilm", models["text"][:2], day1, day2, work / "stage"))
        if "mlp" in only:
            print(f"== torch MLP, {args.mlp_rows:,} rows x {len(FEATURES)} float32 features, 2% changed", flush=True)
            day1 = make_features(work / "in" / "mlp-day1", args.mlp_rows)
            day2 = _changed_features(day1, work / "in" / "mlp-day2")
            results.append(workload("mlp", models["mlp"][:2], day1, day2, work / "stage"))
    finally:
        from airflow_provider_batchinfer.launchers.embedded.embedded_ray import shutdown

        shutdown(Path(ray_dir))
        shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    report = {"load_average_before": load_before, "load_average_after": os.getloadavg(), "results": results}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(report, indent=2))
    print()
    for r in results:
        print(
            f"{r['workload']:7s} {r['rows']:>9,} rows: full {r['full']['wall_s']:8.1f}s, incremental "
            f"{r['incremental']['wall_s']:7.1f}s ({r['incremental'].get('reused_rows', 0):,} reused, "
            f"{r['incremental'].get('scored_rows', 0):,} scored) -> incremental/full = {r['incremental_over_full']}; "
            f"day 1 with keys / full = {r['keys_overhead_day1_over_full']}"
        )
    print(f"load average before {load_before}, after {report['load_average_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
