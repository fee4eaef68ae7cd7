"""How much of a Ray cluster a job reserves: the pure planning half of ``resources.py``.

A job's reservation is its replicas spread evenly over ``num_workers`` nodes plus a little CPU on
each for reading and writing; these functions size it, check it against the nodes a cluster has
(free now, or in total) and describe it the way the job's log and errors do. Nothing here talks to
Ray, so the rules are tested without a cluster (``tests/e2e/test_resources.py``,
``tests/unit/test_resource_wait.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.runtime.errors import JobError

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract.specs import JobSpec

# Per node, one whole CPU beside the replicas: Ray Data runs some of its own tasks at its default of
# 1 CPU (in Ray 2.60 the Parquet file listing, ``ListFiles``, runs while the replicas start), and a
# bundle with less than 1 CPU free would never run them: the job would hang inside its own
# reservation (seen with 0.5 on Ray 2.60). The ``rows_per_part`` repartition would be another such
# task, held for the whole read; it asks for ``IO_TASK_CPU`` instead (``part_rows.py``).
IO_SHARE_CPU = 1.0
IO_TASK_CPU = 0.25  # what one read, write or filter task asks for: four at a time in the share
# Each replica also asks for a token of memory, and each node's bundle holds exactly its replicas'
# tokens, so no node's bundle can take a replica more than its share (its spare CPU could otherwise
# hold one), and ``num_workers`` is an exact spread. ``JobSpec.memory``, when set, plays that role.
REPLICA_TOKEN_BYTES = 1 << 20
GRACE_S = 3.0  # how long a reservation that looked free may take before we try a smaller one
LOG_EVERY_S = 10.0

Nodes = Sequence[Mapping[str, float]]  # per alive node: {"CPU": .., "GPU": .., "memory": ..}


class ResourceError(JobError):
    """The cluster cannot give the job its minimum: ``permanent`` when it never could (too few or
    too small nodes), not when other jobs hold what it needs (a retry may find it free)."""

    def __init__(self, message: str, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.permanent))


@dataclass(frozen=True)
class Reservation:
    """One placement group's worth: ``per_node[i]`` replicas (each ``num_cpus`` / ``num_gpus`` /
    ``memory``) plus ``io_cpus`` for read and write tasks on the i-th node, every node distinct."""

    per_node: tuple[int, ...]
    num_cpus: float
    num_gpus: float
    memory: int | None
    io_cpus: float
    min_replicas: int

    @property
    def replicas(self) -> int:
        return sum(self.per_node)

    @property
    def strategy(self) -> str:
        """One bundle per node: STRICT_SPREAD puts each on its own node (one bundle is one node)."""
        return "STRICT_PACK" if len(self.per_node) == 1 else "STRICT_SPREAD"

    def bundles(self) -> list[dict[str, float]]:
        out = []
        for n in self.per_node:
            bundle = {"CPU": round(n * self.num_cpus + self.io_cpus, 4)}
            if self.num_gpus:
                bundle["GPU"] = n * self.num_gpus
            bundle["memory"] = float(n * self.replica_memory)
            out.append(bundle)
        return out

    @property
    def replica_memory(self) -> int:
        """What each replica asks Ray for as ``memory``: ``JobSpec.memory`` or the spread token."""
        return self.memory or REPLICA_TOKEN_BYTES

    @property
    def cpus(self) -> float:
        return round(sum(b["CPU"] for b in self.bundles()), 4)

    @property
    def gpus(self) -> float:
        return self.replicas * self.num_gpus

    def describe(self) -> str:
        """``"2 replicas x 1 CPU + 0.5 CPU for reading and writing"`` (``" on each of 2 nodes"``)."""
        nodes = len(self.per_node)
        each = (
            " + ".join(f"{v:g} {unit}" for v, unit in ((self.num_cpus, "CPU"), (self.num_gpus, "GPU")) if v) or "0 CPU"
        )
        spread = f" over {nodes} nodes ({'/'.join(map(str, self.per_node))})" if nodes > 1 else ""
        io = f"{self.io_cpus:g} CPU for reading and writing" + (" on each node" if nodes > 1 else "")
        return f"{self.replicas} replica{'s' if self.replicas != 1 else ''} x {each}{spread} + {io}"


def spread(replicas: int, nodes: int) -> tuple[int, ...]:
    """``replicas`` over ``nodes`` as evenly as possible, largest first (5 over 2: (3, 2))."""
    base, extra = divmod(replicas, nodes)
    return tuple(base + (1 if i < extra else 0) for i in range(nodes))


def reservation(job: JobSpec, replicas: int) -> Reservation:
    per_node = spread(replicas, job.num_workers)
    return Reservation(
        per_node=per_node,
        num_cpus=float(job.num_cpus),
        num_gpus=float(job.num_gpus),
        memory=job.memory,
        io_cpus=IO_SHARE_CPU,
        min_replicas=job.num_workers,
    )


def fits(res: Reservation, nodes: Nodes) -> bool:
    """Whether each bundle can go on its own node of ``nodes`` (largest bundle first, onto the
    smallest node that holds it: exact for one kind of resource, a good estimate for more; the
    placement group itself is the authority)."""
    free = [dict(n) for n in nodes]
    for bundle in sorted(res.bundles(), key=lambda b: (b.get("GPU", 0), b["CPU"]), reverse=True):
        room = [n for n in free if all(_has(n, k) + 1e-9 >= v for k, v in bundle.items())]
        if not room:
            return False
        free.remove(min(room, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0))))
    return True


def _has(node: Mapping[str, float], key: str) -> float:
    """A node's amount of ``key``; one that does not say its memory is not limited by it."""
    return node.get(key, float("inf") if key == "memory" else 0.0)


def largest_fit(job: JobSpec, nodes: Nodes, cap: int | None = None) -> Reservation | None:
    """The most replicas (``num_workers`` .. ``min(replicas, cap)``) whose reservation fits ``nodes``."""
    top = min(job.replicas, cap) if cap else job.replicas
    for k in range(top, job.num_workers - 1, -1):
        res = reservation(job, k)
        if fits(res, nodes):
            return res
    return None


def cluster_summary(nodes: Nodes, total: Nodes) -> str:
    """``"0.5 of 2 CPU free"`` (and GPUs, and nodes when there are several)."""
    parts = []
    for key in ("CPU", "GPU"):
        have = sum(n.get(key, 0.0) for n in total)
        if have or key == "CPU":
            parts.append(f"{sum(n.get(key, 0.0) for n in nodes):g} of {have:g} {key}")
    where = f" on {len(total)} nodes" if len(total) != 1 else ""
    return f"{' and '.join(parts)} free{where}"


def node_sizes(nodes: Nodes, gpus: bool) -> str:
    """``"0 CPU, 2 CPU/1 GPU"``: each node's resources, as the messages name them."""
    return ", ".join(f"{n.get('CPU', 0):g} CPU" + (f"/{n.get('GPU', 0):g} GPU" if gpus else "") for n in nodes)


def never_fits_advice(job: JobSpec, total: Nodes) -> str:
    """What to change when no ``num_workers`` nodes of ``total``, idle, could hold the job's minimum."""
    if len(total) < job.num_workers:
        return f"lower JobSpec.num_workers to {max(1, len(total))} or add nodes"
    if job.num_gpus and not any(n.get("GPU", 0) >= job.num_gpus for n in total):
        return "run on a GPU cluster (launcher ray_jobs) or set JobSpec(num_gpus=0)"
    return "lower JobSpec.num_cpus / num_gpus / memory, or add larger nodes"


def check_ever_fits(job: JobSpec, total: Nodes, cluster_grows: bool = True) -> Reservation:
    """The job's minimum reservation, or the permanent error of a job that does not wait
    (``resource_wait_s=0``, or a Ray that never adds nodes: ``cluster_grows`` False) when the
    cluster's nodes, even idle, could never hold it (too few nodes for ``num_workers``, too small
    for one replica)."""
    least = reservation(job, job.num_workers)
    if fits(least, total):
        return least
    if cluster_grows:
        tail = "; or give JobSpec.resource_wait_s > 0 to wait for such nodes to join"
    else:
        tail = " (this Ray runs on this machine alone and never adds a node)"
    raise ResourceError(
        f"the Ray cluster can never give this job its minimum, {least.describe()}: it has {len(total)} "
        f"node(s) ({node_sizes(total, bool(job.num_gpus))}) and each of {job.num_workers} node(s) must hold its share; "
        f"{never_fits_advice(job, total)}{tail}",
        permanent=True,
    )
