"""Shared set-up for the Iceberg tests: operators writing tables, and reading a table the way an
independent engine would (a fresh process, or plain pyiceberg with no batchinfer code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}

# a fresh interpreter that knows nothing of batchinfer: pyiceberg opens the catalog, scans the
# snapshot for one run key, and DuckDB counts what it got
READER = r"""
import json, sys
import duckdb
from pyiceberg.catalog import load_catalog
from pyiceberg.expressions import EqualTo
args = json.loads(sys.argv[1])
props = args["catalog"]
catalog = load_catalog(props.pop("name"), **props)
table = catalog.load_table(args["table"])
rows = table.scan(row_filter=EqualTo("batchinfer_run_key", args["run_key"]), snapshot_id=args["snapshot_id"]).to_arrow()
con = duckdb.connect()
con.register("preds", rows)
n, lo, hi, total = con.execute("select count(*), min(ticket_id), max(ticket_id), sum(length) from preds").fetchone()
print(json.dumps({"rows": n, "min": lo, "max": hi, "sum_length": int(total), "ids": sorted(rows.column("ticket_id").to_pylist())}))
"""


def read_in_fresh_process(catalog: dict[str, str], table: str, run_key: str, snapshot_id: int) -> dict[str, Any]:
    arg = json.dumps({"catalog": dict(catalog), "table": table, "run_key": run_key, "snapshot_id": snapshot_id})
    out = subprocess.run([sys.executable, "-c", READER, arg], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def operator(table: str, inputs: str | Path, mode: Any = None, model: str = "text_length", **kwargs: Any) -> Any:
    from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode

    return BatchInferenceOperator(
        task_id=kwargs.pop("task_id", "infer"),
        model=model,
        version="v1",
        input=str(inputs),
        input_spec=InputSpec(columns=["ticket_id", "text"]),
        output_spec=OutputSpec(table=table, mode=mode or SaveMode.ERROR),
        job_spec=JobSpec(**{"max_batch_rows": 100, "progress_interval_s": 1, **kwargs}),
    )


def data_files(table: Any) -> dict[str, str]:
    """``{data file path: run key}`` of the table's current snapshot."""
    return {t.file.file_path: t.file.partition[0] for t in table.scan().plan_files()}
