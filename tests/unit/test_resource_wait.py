"""How a job waits for its resources (``runtime/planning/resources.py``), without Ray: a placement group
that a fake clock grants (or never grants), and the nodes a cluster reports."""

from __future__ import annotations

import pytest

from airflow_provider_batchinfer.contract.specs import JobSpec
from airflow_provider_batchinfer.runtime.planning.resources import (
    ResourceError,
    minimum_need,
    one_node_need,
    reserve,
    wait_for_free,
    wait_on,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Group:
    """A pending placement group, granted at ``granted_at`` on ``clock`` (never when None)."""

    def __init__(self, clock: Clock, granted_at: float | None = None) -> None:
        self.clock, self.granted_at = clock, granted_at

    def wait(self, timeout_seconds: float) -> bool:
        if self.granted_at is not None and self.clock.now + timeout_seconds >= self.granted_at:
            self.clock.now = max(self.clock.now, self.granted_at)
            return True
        self.clock.now += timeout_seconds
        return False


def _cluster(total, available=None):
    return lambda which: available if which == "available" and available is not None else total


def test_a_job_no_node_could_hold_waits_saying_so_and_fails_retryable_naming_what_it_waited_for():
    clock, said = Clock(), []
    with pytest.raises(ResourceError) as exc:
        wait_on(Group(clock), minimum_need(JobSpec(num_cpus=2)), 30, said.append, clock, 0.0, _cluster([{"CPU": 0.0}]))
    assert not exc.value.permanent  # a retry may find the node that never joined here
    assert str(exc.value) == (
        "gave up after 30s waiting for 1 replica x 2 CPU + 1 CPU for reading and writing for nodes that can hold it "
        "to join: the Ray cluster's 1 node(s) (0 CPU) could never hold it, and none that could joined. Nothing was "
        "written. Lower JobSpec.num_cpus / num_gpus / memory, or add larger nodes (an autoscaler adds nodes for a "
        "waiting job when its node types can hold it), or raise JobSpec.resource_wait_s (now 30)"
    )
    assert said == [
        "[batchinfer] resources: waiting for 1 replica x 2 CPU + 1 CPU for reading and writing; the cluster has 0 of "
        f"0 CPU free, and its 1 node(s) (0 CPU) could never hold that: waiting for nodes that can to join (waited "
        f"{s}s of JobSpec.resource_wait_s=30)"
        for s in (3, 13, 23)
    ]


def test_a_waiting_job_is_reserved_as_soon_as_its_group_is_granted():
    clock, said = Clock(), []
    waited = wait_on(Group(clock, granted_at=15.0), minimum_need(JobSpec()), 600, said.append, clock, 0.0, _cluster([]))
    assert waited == 15.0 and len(said) == 2  # at 3 s and 13 s


def test_a_job_on_a_busy_cluster_that_could_hold_it_says_other_jobs_hold_the_rest():
    clock, said = Clock(), []
    cluster = _cluster([{"CPU": 2.0}], available=[{"CPU": 0.0}])
    with pytest.raises(ResourceError, match=r"^gave up after 5s .* the Ray cluster has 0 of 2 CPU free: other jobs"):
        wait_on(Group(clock), minimum_need(JobSpec()), 5, said.append, clock, 0.0, cluster)
    assert said == [
        "[batchinfer] resources: waiting for 1 replica x 1 CPU + 1 CPU for reading and writing; the cluster has 0 of "
        "2 CPU free (waited 3s of JobSpec.resource_wait_s=5)"
    ]


def test_a_vllm_job_waits_for_a_gpu_node_to_join_naming_the_nodes_it_saw():
    clock, said = Clock(), []
    need = one_node_need({"GPU": 1.0}, "1 GPU(s) for one vLLM engine replica")
    with pytest.raises(ResourceError) as exc:
        wait_on(Group(clock), need, 4, said.append, clock, 0.0, _cluster([{"CPU": 4.0, "GPU": 0.0}]))
    assert not exc.value.permanent
    assert str(exc.value).startswith(
        "gave up after 4s waiting for 1 GPU(s) for one vLLM engine replica for nodes that can hold it to join: the "
        "Ray cluster's 1 node(s) (4 CPU/0 GPU) could never hold it, and none that could joined. Nothing was written. "
        "Add such a node (an autoscaler"
    )
    assert "its 1 node(s) (4 CPU/0 GPU) could never hold that: waiting for nodes that can to join" in said[0]


def test_only_a_job_that_does_not_wait_fails_at_once_and_permanently_where_no_node_could_hold_it():
    """It left no pending demand for an autoscaler to answer: a retry would see the same cluster."""
    cpu_only = _cluster([{"CPU": 0.0}])
    with pytest.raises(ResourceError, match=r"can never give this job its minimum, 1 replica x 2 CPU") as exc:
        reserve(JobSpec(num_cpus=2, resource_wait_s=0), "job", print, nodes=cpu_only)
    assert exc.value.permanent and "give JobSpec.resource_wait_s > 0 to wait for such nodes to join" in str(exc.value)
    with pytest.raises(ResourceError, match=r"no node of the Ray cluster has 1 GPU\(s\); add such a node") as exc:
        wait_for_free({"GPU": 1.0}, "1 GPU(s)", JobSpec(num_gpus=1, resource_wait_s=0), nodes=cpu_only)
    assert exc.value.permanent


def test_a_ray_on_this_machine_alone_never_grows_so_a_job_it_can_never_hold_fails_at_once():
    """The embedded default and a private ``local`` Ray never add a node: waiting there for one to
    join would only hold the task for ``resource_wait_s``."""
    from types import SimpleNamespace

    from airflow_provider_batchinfer.contract.lines import EMBEDDED_RAY_ENV
    from airflow_provider_batchinfer.runtime.attach import cluster_can_grow

    def job(address):  # the one field of the job file the rule reads
        return SimpleNamespace(ray_address=address)

    assert not cluster_can_grow(job(None), {EMBEDDED_RAY_ENV: "1", "RAY_ADDRESS": "10.0.0.1:6379"})
    assert not cluster_can_grow(job(None), {})  # no address anywhere: a private Ray for this job
    assert not cluster_can_grow(job("local"), {"RAY_ADDRESS": "10.0.0.1:6379"})
    assert cluster_can_grow(job(None), {"RAY_ADDRESS": "10.0.0.1:6379"})
    assert cluster_can_grow(job("ray://head:10001"), {})

    cpu_only = _cluster([{"CPU": 0.0}])
    with pytest.raises(ResourceError, match=r"can never give this job its minimum, 1 replica x 2 CPU") as exc:
        reserve(JobSpec(num_cpus=2, resource_wait_s=600), "job", print, nodes=cpu_only, cluster_grows=False)
    assert exc.value.permanent and "never adds a node" in str(exc.value)
    assert "resource_wait_s" not in str(exc.value)
