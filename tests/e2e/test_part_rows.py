"""``JobSpec.rows_per_part``'s streaming repartition runs at the read and write tasks' CPU share
(``runtime/engine/part_rows.py``): a 1-CPU repartition task took the whole share beside one replica and the
job idled ~20 s after its first part."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_batchinfer.runtime.planning.resources import IO_TASK_CPU

# Runs in its own process on the session's 2-CPU cluster, in the job's shape (a 2-CPU placement group that Ray
# Data budgets with, a filter and reads at the io share, one 1-CPU replica), rows_per_part=40.
_PIPELINE = textwrap.dedent(
    """
    import json, sys
    import ray, ray.data
    from ray.data._internal.execution.interfaces import ExecutionResources
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from airflow_provider_batchinfer.runtime.engine.part_rows import cut_into_parts, repartition_remote_args

    ray.init(address=sys.argv[3], log_to_driver=False, logging_level="ERROR")
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    group = placement_group([{"CPU": 2}])
    ray.get(group.ready())
    ctx.scheduling_strategy = PlacementGroupSchedulingStrategy(group)
    ctx.execution_options.resource_limits = ExecutionResources.for_limits(cpu=2, gpu=0)
    io = {"num_cpus": float(sys.argv[2])}

    def keep_all(batch):  # stands for RESUME's drop_done: a filter at the io share
        return batch

    class Replica:  # stands for the model: an actor at 1 CPU
        def __call__(self, batch):
            return batch

    ds = ray.data.read_parquet(sys.argv[1], ray_remote_args=io, concurrency=2)
    ds = ds.map_batches(keep_all, batch_size=None, batch_format="pyarrow", **io)
    before = repartition_remote_args(ds)  # None: the last operator is no repartition
    ds = cut_into_parts(ds, 40, io)
    args = dict(repartition_remote_args(ds) or {})
    ds = ds.map_batches(Replica, batch_size=40, batch_format="pyarrow", num_cpus=1,
                        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=1))
    blocks = [ray.get(ref) for ref in ds.to_arrow_refs()]
    print(json.dumps({
        "before": before,
        "args": {"num_cpus": args.get("num_cpus")},
        "block_rows": [b.num_rows for b in blocks],
        "ids": sorted(i for b in blocks for i in b.column("id").to_pylist()),
        "stats": ds.stats(),
    }))
    """
)


def test_the_repartition_asks_for_the_io_share_and_fuses_with_the_filter_before_it(ray_cluster, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(3):  # 100 rows a file: every file is cut into 40 + 40 + 20
        ids = list(range(i * 100, i * 100 + 100))
        pq.write_table(pa.table({"id": ids, "text": [f"t{n}" for n in ids]}), inputs / f"f{i}.parquet")
    done = subprocess.run(
        [sys.executable, "-c", _PIPELINE, str(inputs), str(IO_TASK_CPU), ray_cluster["address"]],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # the logical operator took the io share (Ray holds it where part_rows.py looks for it)
    assert result["before"] is None
    assert result["args"]["num_cpus"] == IO_TASK_CPU, result["args"]
    # every row once, in blocks of at most rows_per_part rows
    assert result["ids"] == list(range(300))
    assert max(result["block_rows"]) <= 40 and sum(result["block_rows"]) == 300, result["block_rows"]
    # Ray Data fuses a filter into the repartition only when both ask for the same resources
    assert "MapBatches(keep_all)->StreamingRepartition" in result["stats"], result["stats"][:2000]
