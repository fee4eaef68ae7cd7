"""The Airflow task process holds no rows of an Iceberg input: its peak memory with a 2M-row table is
what it is with a 20k-row one, and the job's own log names the read (``benchmarks/iceberg_input.py``,
run as a new user would: each table scored by ``BatchInferenceOperator.execute`` in a fresh task
process of its own, on the embedded default)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def test_a_2m_row_iceberg_input_costs_the_task_process_no_more_memory_than_20k_rows(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "AIRFLOW__", "BATCHINFER_"))}
    env["TMPDIR"] = str(tmp_path)  # the benchmark's stage, registry and catalog
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.iceberg_input", "--small", "20000", "--large", "2000000"],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)
    peaks = {
        name: float(mib)
        for name, mib in re.findall(
            r"raw\.(small|large):\s+[\d,]+ rows\s+task process peak RSS\s+([\d.]+) MiB", out.stdout
        )
    }
    assert set(peaks) == {"small", "large"}, out.stdout
    assert peaks["large"] < 1.2 * peaks["small"], peaks
    # the job read each table itself (the runtime's process, on the Ray side), at the pinned snapshot
    assert re.search(
        r"\[batchinfer\] input: 2,000,000 rows of Iceberg table raw\.large at snapshot \d+ read in", out.stdout
    )
    assert re.search(
        r"\[batchinfer\] input: 20,000 rows of Iceberg table raw\.small at snapshot \d+ read in", out.stdout
    )
