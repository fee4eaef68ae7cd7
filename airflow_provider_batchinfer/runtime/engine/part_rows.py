"""``JobSpec.rows_per_part``: cut the stream into blocks of at most that many rows before the model,
with the streaming repartition asking for the read and write tasks' CPU share, not 1 CPU.

Why not plain ``Dataset.repartition(target_num_rows_per_block=...)``: Ray Data (2.50-2.60) gives its
``StreamingRepartition`` tasks no way to set their resources, so they ask for Ray's default of 1 CPU.
Inside the job's reservation (one replica's CPU plus one CPU for reads and writes, ``resources.py``)
a running repartition task took the whole share: the write tasks could not start, the replica's
outputs backed up, and the job idled ~20 s after its first part (seen on Ray 2.60 in the killed-task
and budget tests, one part of 40 rows, then nothing until the read task ended). At the io share the
repartition also fuses with a ``map_batches`` before it at that share (incremental reuse's keys),
which a 1-CPU op cannot.

A ``map_batches`` that slices its batch cannot replace it: Ray Data merges the slices a task yields
back into one block (up to ``target_max_block_size``), so the parts would not get smaller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.data import Dataset


def cut_into_parts(ds: Dataset, rows_per_part: int, remote_args: Mapping[str, Any]) -> Dataset:
    """``ds`` repartitioned to blocks of at most ``rows_per_part`` rows, its tasks at ``remote_args``.

    The logical operator holds its remote arguments in a dict it made for itself (a dataclass field
    ``ray_remote_args`` on Ray 2.60, the attribute ``_ray_remote_args`` on 2.50); that dict is updated
    in place. A Ray that holds them elsewhere keeps its 1-CPU default: slower, still correct, and
    ``tests/component/test_part_rows.py`` fails on it so the next Ray upgrade sees it."""
    cut = ds.repartition(target_num_rows_per_block=rows_per_part)
    args = repartition_remote_args(cut)
    if args is not None:
        args.update(remote_args)
    return cut


def repartition_remote_args(ds: Dataset) -> dict[str, Any] | None:
    """The remote arguments dict of ``ds``'s last logical operator when it is a streaming repartition."""
    op = ds._logical_plan.dag
    if type(op).__name__ != "StreamingRepartition":
        return None
    for name in ("ray_remote_args", "_ray_remote_args"):
        args = getattr(op, name, None)
        if isinstance(args, dict):
            return args
    return None
