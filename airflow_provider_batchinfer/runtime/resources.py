"""What a job reserves on a shared Ray cluster, and how it waits for it.

Why: a pool sized from the cluster's *total* CPUs lets several jobs on one cluster each hold
replicas while none has a CPU left for its read and write tasks, and all of them hang (three
concurrent runs on a 2-CPU cluster did, checked on Ray 2.60). Instead a job

1. plans the largest reservation that fits what the cluster has *free* now (replicas between
   ``num_workers`` and ``JobSpec.replicas``, spread evenly over ``num_workers`` nodes, each node's
   share plus a little CPU for reading and writing),
2. reserves it with one placement group: creating a placement group is atomic, so a job holds
   either all it needs (replicas *and* I/O) or nothing, and two jobs can never starve each other;
3. runs Ray Data inside it (``DataContext.scheduling_strategy``) with the read and write tasks on
   fractional CPUs and the actor pool autoscaling between its minimum and the replicas reserved.

A job that cannot get its minimum waits, saying every ~10 s what for, up to
``JobSpec.resource_wait_s``, then fails (retryable) naming what it waited for; a cluster whose
nodes could never hold the minimum fails at once (permanent). The planning functions here are
pure and tested without Ray; the ones that talk to Ray import it inside.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.runtime.errors import JobError

if TYPE_CHECKING:
    from airflow_provider_batchinfer.specs import JobSpec

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


def check_ever_fits(job: JobSpec, total: Nodes) -> Reservation:
    """The job's minimum reservation, or a permanent error when the cluster's nodes, even idle,
    could never hold it (too few nodes for ``num_workers``, too small for one replica)."""
    least = reservation(job, job.num_workers)
    if fits(least, total):
        return least
    sizes = ", ".join(f"{n.get('CPU', 0):g} CPU" + (f"/{n.get('GPU', 0):g} GPU" if job.num_gpus else "") for n in total)
    if len(total) < job.num_workers:
        fix = f"lower JobSpec.num_workers to {max(1, len(total))} or add nodes"
    elif job.num_gpus and not any(n.get("GPU", 0) >= job.num_gpus for n in total):
        fix = "run on a GPU cluster (launcher ray_jobs) or set JobSpec(num_gpus=0)"
    else:
        fix = "lower JobSpec.num_cpus / num_gpus / memory, or add larger nodes"
    raise ResourceError(
        f"the Ray cluster can never give this job its minimum, {least.describe()}: it has {len(total)} "
        f"node(s) ({sizes}) and each of {job.num_workers} node(s) must hold its share; {fix}",
        permanent=True,
    )


# --- the Ray side ----------------------------------------------------------------------------------


def _nodes(which: str) -> list[dict[str, float]]:
    """Per alive node, its free (``"available"``) or ``"total"`` resources."""
    import ray._private.state as state

    per_node = state.available_resources_per_node() if which == "available" else state.total_resources_per_node()
    return [{k: float(v) for k, v in r.items() if k in ("CPU", "GPU", "memory")} for r in per_node.values()]


@dataclass
class Reserved:
    """A reservation the cluster granted: the placement group and what it holds."""

    plan: Reservation
    group: Any  # ray.util.placement_group.PlacementGroup
    waited_s: float


def _try(plan: Reservation, wait_s: float, name: str) -> Any | None:
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(plan.bundles(), strategy=plan.strategy, name=name)
    if group.wait(wait_s):
        return group
    remove_placement_group(group)
    return None


def reserve(
    job: JobSpec, name: str, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic
) -> Reserved:
    """Reserve the most replicas the cluster can give now (at least ``num_workers``), waiting up to
    ``job.resource_wait_s`` for the minimum; see the module's docstring."""
    started = clock()
    check_ever_fits(job, _nodes("total"))
    cap: int | None = None
    while True:  # while more than the minimum looks free: try it, and step down when another job won
        plan = largest_fit(job, _nodes("available"), cap)
        if plan is None or plan.replicas == job.num_workers:
            break
        group = _try(plan, GRACE_S, name)
        if group is not None:
            return Reserved(plan, group, clock() - started)
        cap = plan.replicas - 1
    return _wait_for_minimum(job, name, say, clock, started)


def _wait_for_minimum(
    job: JobSpec, name: str, say: Callable[[str], None], clock: Callable[[], float], started: float
) -> Reserved:
    """One pending placement group for the minimum: Ray grants pending groups as resources free up,
    so waiting jobs are served in turn, each atomically."""
    from ray.util.placement_group import placement_group, remove_placement_group

    least = reservation(job, job.num_workers)
    group = placement_group(least.bundles(), strategy=least.strategy, name=name)
    deadline = started + job.resource_wait_s
    try:
        if group.wait(max(0.0, min(GRACE_S, deadline - clock()))):
            return Reserved(least, group, clock() - started)
        while True:
            free = cluster_summary(_nodes("available"), _nodes("total"))
            if clock() >= deadline:
                raise ResourceError(
                    f"gave up after {clock() - started:.0f}s waiting for {least.describe()} (the job's minimum); "
                    f"the Ray cluster has {free}: other jobs hold the rest. Nothing was written. Retry when "
                    f"the cluster is less busy (the task's retries will), raise JobSpec.resource_wait_s "
                    f"(now {job.resource_wait_s:g}), or lower JobSpec.num_cpus / num_workers",
                    permanent=False,
                )
            say(
                f"[batchinfer] resources: waiting for {least.describe()}; the cluster has {free} "
                f"(waited {clock() - started:.0f}s of JobSpec.resource_wait_s={job.resource_wait_s:g})"
            )
            if group.wait(max(0.0, min(LOG_EVERY_S, deadline - clock()))):
                return Reserved(least, group, clock() - started)
    except BaseException:
        remove_placement_group(group)
        raise


@contextmanager
def reserved(job: JobSpec, name: str, say: Callable[[str], None] = print) -> Iterator[Reserved]:
    """Reserve (see :func:`reserve`), run Ray Data inside the reservation, and always give it back."""
    from ray.util.placement_group import remove_placement_group

    held = reserve(job, name, say)
    try:
        use_for_ray_data(held)
        yield held
    finally:
        remove_placement_group(held.group)


def use_for_ray_data(held: Reserved) -> None:
    """Every Ray Data task and actor of this driver runs in the placement group, and Ray Data budgets
    with exactly what it holds (``resource_limits``), so its operators never wait for more."""
    import warnings

    import ray.data
    from ray.data._internal.execution.interfaces import ExecutionResources
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ctx = ray.data.DataContext.get_current()
    strategy = PlacementGroupSchedulingStrategy(held.group)
    with warnings.catch_warnings():
        # Ray 2.60 marks these setters deprecated ("removed after January 2027") while Ray Data still
        # honours them (its placement-group autoscaler is chosen from them); only that warning is hidden
        warnings.filterwarnings("ignore", message=r"`DataContext\.scheduling_strategy", category=DeprecationWarning)
        ctx.scheduling_strategy = strategy
        ctx.scheduling_strategy_large_args = strategy
    ctx.execution_options.resource_limits = ExecutionResources.for_limits(cpu=held.plan.cpus, gpu=held.plan.gpus)
    # DataContext.wait_for_min_actors_s stays at Ray's default (-1: start the pool asynchronously):
    # the reservation already holds the minimum pool, and that wait would also count each replica's
    # model download and load, which may take minutes on a large model


def wait_for_free(need: Mapping[str, float], what: str, job: JobSpec, say: Callable[[str], None] = print) -> None:
    """For pipelines that reserve for themselves (``ray.data.llm`` creates its own placement groups):
    wait up to ``job.resource_wait_s`` until ``need`` is free on one node, logging what it waits for."""
    total = _nodes("total")
    if not any(all(n.get(k, 0) >= v for k, v in need.items()) for n in total):
        raise ResourceError(f"no node of the Ray cluster has {what}; add such a node", permanent=True)
    started = time.monotonic()
    last = started
    while not any(all(n.get(k, 0) + 1e-9 >= v for k, v in need.items()) for n in _nodes("available")):
        now = time.monotonic()
        free = cluster_summary(_nodes("available"), total)
        if now - started >= job.resource_wait_s:
            raise ResourceError(
                f"gave up after {now - started:.0f}s waiting for {what}; the Ray cluster has {free}. Retry later, "
                f"or raise JobSpec.resource_wait_s (now {job.resource_wait_s:g})",
                permanent=False,
            )
        if now - last >= LOG_EVERY_S:
            say(f"[batchinfer] resources: waiting for {what}; the cluster has {free}")
            last = now
        time.sleep(1.0)
