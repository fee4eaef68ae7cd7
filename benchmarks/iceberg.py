"""1M rows into an Iceberg table vs the same job writing Parquet parts.

``PYTHONPATH=. python -m benchmarks.iceberg [--rows 1000000] [--repeat 1]``: one process drives
``BatchInferenceOperator.execute`` as a task runs it, on the embedded default (local stage, SQLite
catalog, the warm embedded Ray, started once here and stopped at the end) with a cheap Python model
(text length), so the figure is about the output path: the same input, model and pool, written once
as Parquet parts with ``_SUCCESS`` and once into a table (data files + one snapshot). A small warm-up
job runs first so neither side pays for starting Ray. Reports wall seconds per run, the runtime's
own timings from the manifest and the ratio table ÷ parts; run it on an idle machine (load average
is printed before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _write_input(directory: Path, rows: int, files: int = 8) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True)
    per = -(-rows // files)
    for n, start in enumerate(range(0, rows, per)):
        ids = range(start, min(rows, start + per))
        pq.write_table(
            pa.table({"ticket_id": pa.array(ids, pa.int64()), "text": [f"ticket {i}: export is slow" for i in ids]}),
            directory / f"part-{n:02d}.parquet",
        )


def _run(inputs: Path, run_id: str, table: str | None, out: str) -> tuple[float, dict[str, Any]]:
    from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode

    spec = OutputSpec(table=table, mode=SaveMode.OVERWRITE) if table else OutputSpec(base_stage_location=out)
    op = BatchInferenceOperator(
        task_id="bench",
        model="bench_length",
        version="v1",
        input=str(inputs),
        input_spec=InputSpec(columns=["ticket_id", "text"]),
        output_spec=spec,
        job_spec=JobSpec(replicas=1, max_batch_rows=65536),
    )
    ti = SimpleNamespace(dag_id="bench_iceberg", task_id="bench", run_id=run_id, try_number=1, map_index=-1)
    t0 = time.monotonic()
    xcom = op.execute({"ti": ti})
    return time.monotonic() - t0, xcom


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.iceberg")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bi-ice-"))
    os.environ.update(
        {
            "AIRFLOW_HOME": str(work / "airflow"),
            "BATCHINFER_HOME": str(work / "home"),
            "BATCHINFER_RAY_DIR": tempfile.mkdtemp(prefix="bir-ice-", dir="/tmp"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
    )
    os.environ.pop("RAY_ADDRESS", None)
    os.environ["AIRFLOW_CONN_BATCHINFER_DEFAULT"] = json.dumps(
        {"conn_type": "batchinfer", "extra": {"stage_root": str(work / "stage"), "registry_root": str(work / "reg")}}
    )
    from airflow_provider_batchinfer.launchers.embedded.embedded_ray import shutdown
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import TextLength

    print(f"load average before: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    ModelRegistry(str(work / "reg")).log_model(
        "bench_length",
        "v1",
        "python",
        python_class=TextLength,
        signature={"inputs": {"text": "string"}, "outputs": {"length": "int64"}},
    )
    _write_input(work / "warm", 1000, files=1)
    _write_input(work / "input", args.rows)
    results: dict[str, list[float]] = {"parts": [], "table": []}
    try:
        _run(work / "warm", "warm-up", None, "warm")
        for i in range(args.repeat):
            for kind in ("parts", "table"):
                wall, xcom = _run(work / "input", f"run{i}", "bench.scores" if kind == "table" else None, "parts")
                assert xcom["rows"] == args.rows, xcom
                results[kind].append(wall)
                print(f"{kind:5s} run {i}: {wall:6.1f} s  {args.rows / wall:>9,.0f} rows/s  {xcom['output_location']}")
    finally:
        shutdown(Path(os.environ["BATCHINFER_RAY_DIR"]))
        shutil.rmtree(os.environ["BATCHINFER_RAY_DIR"], ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    parts, table = statistics.median(results["parts"]), statistics.median(results["table"])
    print(f"rows {args.rows:,}: parts {parts:.1f} s, table {table:.1f} s, table ÷ parts = {table / parts:.2f}")
    print(f"load average after: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
