"""The actor pool's write tasks gather ``rows_per_write`` rows into one part (``runtime/output/parts.py``,
``pool_dataset.rows_per_write``): without it Ray Data starts a write task, and the job writes a part,
for every scored block."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq

# Runs in its own process on the session's cluster: eight blocks of 100 rows written through the job's
# datasink, once per rows_per_write given on the command line
_WRITE = textwrap.dedent(
    """
    import json, sys
    import pyarrow as pa
    import ray, ray.data
    from airflow_provider_batchinfer.runtime.output.parts import make_datasink

    ray.init(address=sys.argv[2], log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    blocks = [pa.table({"id": list(range(b * 100, b * 100 + 100)), "score": [0.5] * 100}) for b in range(8)]
    written = {}
    for rows in sys.argv[3:]:
        sink = make_datasink(f"{sys.argv[1]}/{rows}", "t1", None, rows_per_write=int(rows) or None)
        ray.data.from_arrow(blocks).write_datasink(sink, concurrency=2)
        written[rows] = [(p.name, p.rows) for p in sink.parts]
    print(json.dumps(written))
    """
)


def test_write_tasks_gather_the_rows_asked_into_each_part_and_write_every_row_once(ray_cluster, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _WRITE, str(tmp_path), ray_cluster["address"], "0", "400"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(done.stdout.strip().splitlines()[-1])
    assert [rows for _, rows in written["0"]] == [100] * 8  # a part per block
    assert [rows for _, rows in written["400"]] == [400, 400]  # two write tasks of 400 rows
    for asked, parts in written.items():
        ids = sorted(i for name, _ in parts for i in pq.read_table(tmp_path / asked / name).column("id").to_pylist())
        assert ids == list(range(800)), asked
        assert sorted(p.name for p in (tmp_path / asked).glob("part-*.parquet")) == sorted(n for n, _ in parts)
