"""Peak memory and seconds of the id column's uniqueness check, at N rows and at N/10.

Run by hand (not part of the suite)::

    .venv/bin/python benchmarks/id_check.py --rows 20000000
    .venv/bin/python benchmarks/id_check.py --rows 2000000 --budget 200000

It writes N unique int64 ids (scattered, so no two files hold a range) in ``--files`` Parquet files
to a temporary directory, then runs ``runtime.rows.unique_ids.check_input_ids`` on them in a fresh
subprocess, sampling that subprocess's resident memory every 0.2 s; then the same for N/10 rows in
as many files. With the check's memory fixed, the peak
RSS ratio of N to N/10 stays near 1 once N is above the per-partition budget; a check that holds
every id grows about tenfold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAMPLE_S = 0.2
_MIX = 0x9E3779B97F4A7C15 >> 1  # odd: multiplying by it modulo 2**63 is a permutation

_CHECK = """
import json, sys
from airflow_provider_batchinfer.runtime.rows.unique_ids import check_input_ids
files, rows, budget = json.loads(sys.argv[1])
check_input_ids(files, "id", None, rows, rows_per_partition=budget)
"""


def write_ids(directory: Path, rows: int, files: int) -> list[str]:
    """``rows`` unique int64 ids over ``files`` Parquet files, written a file at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i, rows_of_file in enumerate(np.array_split(np.arange(rows, dtype=np.uint64), files)):
        ids = ((rows_of_file * np.uint64(_MIX)) & np.uint64((1 << 63) - 1)).astype(np.int64)
        path = directory / f"part-{i:03d}.parquet"
        pq.write_table(pa.table({"id": ids}), path)
        out.append(str(path))
    return out


def run_check(files: list[str], rows: int, budget: int | None) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of the check in a fresh process, RSS sampled every 0.2 s."""
    import psutil

    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _CHECK, json.dumps([files, rows, budget])])
    watched = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(SAMPLE_S)
    if proc.wait() != 0:
        raise SystemExit(f"the check failed (exit {proc.returncode})")
    return time.monotonic() - started, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--budget", type=int, default=None, help="ids per partition (default: Tuning's)")
    args = parser.parse_args()
    print(f"load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="batchinfer-id-bench-") as tmp:
        for rows in (args.rows, args.rows // 10):
            files = write_ids(Path(tmp) / f"rows-{rows}", rows, args.files)
            seconds, peak = run_check(files, rows, args.budget)
            results[rows] = (seconds, peak)
            print(f"{rows:>12,} rows: {seconds:7.2f} s, peak RSS {peak / 2**20:8.1f} MiB", flush=True)
    (big_s, big_rss), (small_s, small_rss) = results[args.rows], results[args.rows // 10]
    print(f"N / (N/10): peak RSS x{big_rss / small_rss:.2f}, seconds x{big_s / small_s:.2f}")


if __name__ == "__main__":
    main()
