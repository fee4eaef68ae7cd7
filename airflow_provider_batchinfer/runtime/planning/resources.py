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
``JobSpec.resource_wait_s``, then fails (retryable) naming what it waited for and the cluster it saw.
It waits on a pending placement group for the minimum: Ray grants pending groups as resources free
up, and a pending group is exactly the demand a Ray autoscaler (or KubeRay's) adds nodes for.

So a cluster whose nodes, even idle, could never hold the minimum (an autoscaling cluster's head
with no CPU and no worker yet; a GPU job before its GPU node is up) waits too, and says so: the
cluster as it is now says nothing about the cluster a minute on, and a driver cannot tell an
autoscaled cluster from a fixed one (``ray start`` runs the same monitor, with no node types, and a
node joined by hand counts as well). Only a job with ``resource_wait_s=0`` fails at once there, and
permanently: it asked not to wait, and it leaves no pending demand behind, so a retry would see the
same cluster. The cost of this rule falls on a fixed cluster too small for the job: it fails after
``resource_wait_s`` instead of at once, and each of its waiting lines says that no node could
ever hold the job. The planning functions (``resource_plan.py``) and the waiting
loop here are pure and tested without Ray; the ones that talk to Ray import it inside.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from airflow_provider_batchinfer.runtime.planning.resource_plan import (
    GRACE_S,
    IO_SHARE_CPU,
    IO_TASK_CPU,
    LOG_EVERY_S,
    REPLICA_TOKEN_BYTES,
    Nodes,
    Reservation,
    ResourceError,
    check_ever_fits,
    cluster_summary,
    fits,
    largest_fit,
    never_fits_advice,
    node_sizes,
    reservation,
    spread,
)

if TYPE_CHECKING:
    from airflow_provider_batchinfer.contract.specs import JobSpec

__all__ = [
    "GRACE_S",
    "IO_SHARE_CPU",
    "IO_TASK_CPU",
    "LOG_EVERY_S",
    "REPLICA_TOKEN_BYTES",
    "Need",
    "Nodes",
    "Reservation",
    "Reserved",
    "ResourceError",
    "check_ever_fits",
    "cluster_summary",
    "fits",
    "largest_fit",
    "minimum_need",
    "one_node_need",
    "reservation",
    "reserve",
    "reserved",
    "spread",
    "wait_for_free",
    "wait_on",
]


@dataclass(frozen=True)
class Need:
    """What a waiting job waits for, as its messages say it: ``what`` (``"1 replica x 1 CPU + ..."``),
    ``holds`` whether nodes, idle, could ever hold it, ``busy`` the end of the error when they could
    (``(seconds waited, cluster summary, resource_wait_s)``: other jobs held it), ``advice`` what to
    change when none could (given the cluster's nodes), and ``gpus`` whether node sizes name GPUs."""

    what: str
    holds: Callable[[Nodes], bool]
    busy: Callable[[float, str, float], str]
    advice: Callable[[Nodes], str]
    gpus: bool

    def waiting(self, free: str, total: Nodes, waited: float, wait_s: float) -> str:
        """The line logged every ~10 s; it says when no node of the cluster could ever hold the need,
        so that a fixed cluster too small for the job shows in the log at once, not at the deadline."""
        joins = ""
        if not self.holds(total):
            joins = (
                f", and its {len(total)} node(s) ({node_sizes(total, self.gpus)}) could never hold that: "
                f"waiting for nodes that can to join"
            )
        return (
            f"[batchinfer] resources: waiting for {self.what}; the cluster has {free}{joins} "
            f"(waited {waited:.0f}s of JobSpec.resource_wait_s={wait_s:g})"
        )

    def gave_up(self, waited: float, free: str, total: Nodes, wait_s: float) -> ResourceError:
        """Retryable either way: another job may free what it waited for, a node that holds it may join."""
        if self.holds(total):
            return ResourceError(self.busy(waited, free, wait_s), permanent=False)
        return ResourceError(
            f"gave up after {waited:.0f}s waiting for {self.what} for nodes that can hold it to join: the Ray "
            f"cluster's {len(total)} node(s) ({node_sizes(total, self.gpus)}) could never hold it, and none that could "
            f"joined. Nothing was written. {_capital(self.advice(total))} (an autoscaler adds nodes for a waiting "
            f"job when its node types can hold it), or raise JobSpec.resource_wait_s (now {wait_s:g})",
            permanent=False,
        )


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def minimum_need(job: JobSpec) -> Need:
    """The job's minimum reservation as a :class:`Need`."""
    least = reservation(job, job.num_workers)

    def busy(waited: float, free: str, wait_s: float) -> str:
        return (
            f"gave up after {waited:.0f}s waiting for {least.describe()} (the job's minimum); "
            f"the Ray cluster has {free}: other jobs hold the rest. Nothing was written. Retry when "
            f"the cluster is less busy (the task's retries will), raise JobSpec.resource_wait_s "
            f"(now {wait_s:g}), or lower JobSpec.num_cpus / num_workers"
        )

    return Need(
        what=least.describe(),
        holds=lambda total: fits(least, total),
        busy=busy,
        advice=lambda total: never_fits_advice(job, total),
        gpus=bool(job.num_gpus),
    )


def one_node_need(need: Mapping[str, float], what: str) -> Need:
    """``need`` free on one node (one vLLM engine replica's GPUs) as a :class:`Need`."""

    def busy(waited: float, free: str, wait_s: float) -> str:
        return (
            f"gave up after {waited:.0f}s waiting for {what}; the Ray cluster has {free}. Retry later, "
            f"or raise JobSpec.resource_wait_s (now {wait_s:g})"
        )

    return Need(
        what=what,
        holds=lambda total: any(all(n.get(k, 0) + 1e-9 >= v for k, v in need.items()) for n in total),
        busy=busy,
        advice=lambda total: "add such a node",
        gpus="GPU" in need,
    )


class PendingGroup(Protocol):
    """What :func:`wait_on` needs of a placement group: ``wait(timeout_s)``, True once granted."""

    def wait(self, timeout_seconds: float) -> bool: ...


def wait_on(
    group: PendingGroup,
    need: Need,
    wait_s: float,
    say: Callable[[str], None],
    clock: Callable[[], float],
    started: float,
    nodes: Callable[[str], Nodes],
) -> float:
    """Wait until the pending placement group ``group`` is granted, up to ``wait_s`` from ``started``;
    the seconds waited. After a short grace, it says every ~10 s what it waits for and what the
    cluster (``nodes("available")`` of ``nodes("total")``) has, and at the deadline raises a
    retryable :class:`ResourceError` naming both. The caller removes the group when this raises."""
    deadline = started + wait_s
    if group.wait(max(0.0, min(GRACE_S, deadline - clock()))):
        return clock() - started
    while True:
        total = nodes("total")
        free = cluster_summary(nodes("available"), total)
        if clock() >= deadline:
            raise need.gave_up(clock() - started, free, total, wait_s)
        say(need.waiting(free, total, clock() - started, wait_s))
        if group.wait(max(0.0, min(LOG_EVERY_S, deadline - clock()))):
            return clock() - started


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
    job: JobSpec,
    name: str,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    nodes: Callable[[str], Nodes] = _nodes,
    cluster_grows: bool = True,
) -> Reserved:
    """Reserve the most replicas the cluster can give now (at least ``num_workers``), waiting up to
    ``job.resource_wait_s`` for the minimum; see the module's docstring. ``cluster_grows`` False (a
    Ray on this machine alone, which never adds a node) fails at once where the job never fits."""
    started = clock()
    if job.resource_wait_s <= 0 or not cluster_grows:  # nothing to wait for where it never could fit
        check_ever_fits(job, nodes("total"), cluster_grows)
    cap: int | None = None
    while True:  # while more than the minimum looks free: try it, and step down when another job won
        plan = largest_fit(job, nodes("available"), cap)
        if plan is None or plan.replicas == job.num_workers:
            break
        group = _try(plan, GRACE_S, name)
        if group is not None:
            return Reserved(plan, group, clock() - started)
        cap = plan.replicas - 1
    return _wait_for_minimum(job, name, say, clock, started, nodes)


def _wait_for_minimum(
    job: JobSpec,
    name: str,
    say: Callable[[str], None],
    clock: Callable[[], float],
    started: float,
    nodes: Callable[[str], Nodes],
) -> Reserved:
    """One pending placement group for the minimum: Ray grants pending groups as resources free up
    (or as nodes join: the group is the demand an autoscaler answers), so waiting jobs are served
    in turn, each atomically."""
    from ray.util.placement_group import placement_group, remove_placement_group

    least = reservation(job, job.num_workers)
    group = placement_group(least.bundles(), strategy=least.strategy, name=name)
    try:
        waited = wait_on(group, minimum_need(job), job.resource_wait_s, say, clock, started, nodes)
    except BaseException:
        remove_placement_group(group)
        raise
    return Reserved(least, group, waited)


@contextmanager
def reserved(
    job: JobSpec, name: str, say: Callable[[str], None] = print, cluster_grows: bool = True
) -> Iterator[Reserved]:
    """Reserve (see :func:`reserve`), run Ray Data inside the reservation, and always give it back."""
    from ray.util.placement_group import remove_placement_group

    held = reserve(job, name, say, cluster_grows=cluster_grows)
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


def wait_for_free(
    need: Mapping[str, float],
    what: str,
    job: JobSpec,
    say: Callable[[str], None] = print,
    nodes: Callable[[str], Nodes] = _nodes,
) -> None:
    """For pipelines that reserve for themselves (``ray.data.llm`` creates its own placement groups):
    wait up to ``job.resource_wait_s`` until ``need`` is free on one node, logging what it waits for.
    It waits on a one-bundle placement group of ``need``, given back once granted: polling what is
    free would leave an autoscaler no demand to add a node for. A job with ``resource_wait_s=0``
    fails at once (permanent) when no node of the cluster has ``need`` at all."""
    wanted = one_node_need(need, what)
    if job.resource_wait_s <= 0 and not wanted.holds(nodes("total")):
        raise ResourceError(
            f"no node of the Ray cluster has {what}; add such a node, or give JobSpec.resource_wait_s > 0 "
            f"to wait for one to join",
            permanent=True,
        )
    from ray.util.placement_group import placement_group, remove_placement_group

    started = time.monotonic()
    group = placement_group([dict(need)], strategy="STRICT_PACK")
    try:
        wait_on(group, wanted, job.resource_wait_s, say, time.monotonic, started, nodes)
    finally:
        remove_placement_group(group)
