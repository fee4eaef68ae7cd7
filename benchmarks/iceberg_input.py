"""The Airflow task process's peak memory with an Iceberg table input: 2M rows against 20k rows.

``PYTHONPATH=. python -m benchmarks.iceberg_input [--small 20000] [--large 2000000]``: one embedded
default (local stage, SQLite catalog) holds two input tables; each is scored by
``BatchInferenceOperator.execute`` (input ``iceberg://...``, a cheap Python text-length model, one
replica) in a fresh process of its own, as a task runs it, and that process reports its peak
resident memory (``VmHWM`` in ``/proc/self/status``). The job reads the table's rows (the runtime,
a separate process): the task process holds none, so its peak should not grow with the table
(wanted: large ÷ small below 1.2). The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

_SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}


def _environment(work: Path) -> dict[str, str]:
    stage, registry = work / "stage", work / "registry"
    extra = {"stage_root": str(stage), "registry_root": str(registry)}
    return {
        "AIRFLOW_HOME": str(work / "airflow"),
        "BATCHINFER_HOME": str(work / "home"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "RAY_USAGE_STATS_ENABLED": "0",
        "BATCHINFER_RAY_DIR": str(work / "ray"),
        "BATCHINFER_WARM_RUNTIME": "0",  # no spare runtime outlives the benchmark
        "AIRFLOW_CONN_BATCHINFER_DEFAULT": json.dumps({"conn_type": "batchinfer", "extra": extra}),
    }


def _peak_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _tables(rows: dict[str, int]) -> None:
    """The input tables ``raw.<name>`` with ``rows[name]`` rows each, in the embedded catalog."""
    import pyarrow as pa

    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.store.iceberg.catalog import open_catalog

    hook = ModelServiceHook()
    catalog = open_catalog(hook.catalog_properties(), hook.storage_options)
    catalog.create_namespace("raw")
    for name, count in rows.items():
        table = None
        for start in range(0, count, 500_000):  # appended in slices: the set-up's own memory stays small
            ids = range(start, min(count, start + 500_000))
            data = pa.table(
                {"ticket_id": pa.array(ids, pa.int64()), "text": [f"ticket {i}: export is slow" for i in ids]}
            )
            if table is None:
                table = catalog.create_table(f"raw.{name}", schema=data.schema)
            table.append(data)


def _task(name: str) -> None:
    """One task process: score ``raw.<name>`` and print its rows and peak RSS as JSON (last line)."""
    from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode
    from airflow_provider_batchinfer.contract.specs import iceberg_input

    op = BatchInferenceOperator(
        task_id="bench",
        model="bench_length",
        version="v1",
        input=iceberg_input(f"raw.{name}"),
        input_spec=InputSpec(columns=["ticket_id", "text"]),
        output_spec=OutputSpec(base_stage_location="scores", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(replicas=1, max_batch_rows=65536),
    )
    ti = SimpleNamespace(dag_id="bench_iceberg_input", task_id="bench", run_id=name, try_number=1, map_index=-1)
    t0 = time.monotonic()
    xcom = op.execute({"ti": ti})
    result = {"rows": xcom["rows"], "peak_rss_kib": _peak_rss_kib(), "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(result), flush=True)


def _measure(name: str, env: dict[str, str]) -> dict[str, int | float]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.iceberg_input", "--task", name],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the task for raw.{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    lines = out.stdout.strip().splitlines()
    for line in lines:
        if "[batchinfer] input:" in line and "Iceberg table" in line:
            print(f"  job log: {line[line.index('[batchinfer]') :][:160]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.iceberg_input")
    parser.add_argument("--small", type=int, default=20_000)
    parser.add_argument("--large", type=int, default=2_000_000)
    parser.add_argument("--task", help=argparse.SUPPRESS)  # internal: run one task process
    args = parser.parse_args(argv)
    if args.task:
        _task(args.task)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bi-ice-in-"))
    env = {**os.environ, **_environment(work)}
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    os.environ.update(env)
    logging.getLogger("pyiceberg").setLevel(logging.WARNING)  # a line per table load otherwise
    print(f"load average before: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    try:
        from airflow_provider_batchinfer.registry import ModelRegistry
        from tests.models import TextLength

        ModelRegistry(str(work / "registry")).log_model(
            "bench_length", "v1", "python", python_class=TextLength, signature=_SIGNATURE
        )
        _tables({"small": args.small, "large": args.large})
        results = {}
        for name in ("small", "large"):
            results[name] = _measure(name, env)
            r = results[name]
            print(
                f"raw.{name}: {r['rows']:>9,} rows  task process peak RSS {r['peak_rss_kib'] / 1024:7.1f} MiB  "
                f"({r['wall_s']} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = results["large"]["peak_rss_kib"] / results["small"]["peak_rss_kib"]
    print(f"peak RSS {args.large:,} rows ÷ {args.small:,} rows = {ratio:.2f} (wanted below 1.2)")
    print(f"load average after: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
