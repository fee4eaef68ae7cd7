"""A job's share of a shared Ray cluster: what it plans and reserves (pure, without Ray), and real
jobs on the session's 2-CPU ``ray start`` cluster: two waiting at once behind another driver take
turns and each commits exactly once, and a job that cannot get its minimum fails after
``resource_wait_s`` naming what it waited for."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, JobFailure, last_failure
from airflow_provider_batchinfer.contract.specs import JobSpec
from airflow_provider_batchinfer.runtime.planning.pipeline import size_actor_pool
from airflow_provider_batchinfer.runtime.planning.resources import (
    ResourceError,
    check_ever_fits,
    cluster_summary,
    fits,
    largest_fit,
    reservation,
    spread,
)
from tests.models import SlowLength, committed_manifest, ticket_job, write_job_file

REPO = Path(__file__).resolve().parents[2]
SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}


# --- planning, without Ray ---------------------------------------------------------------------------


def test_replicas_spread_evenly_over_the_nodes_largest_first():
    assert spread(4, 2) == (2, 2) and spread(5, 2) == (3, 2) and spread(3, 1) == (3,)


def test_a_reservation_holds_its_replicas_and_cpu_for_reading_and_writing():
    mib = float(1 << 20)
    res = reservation(JobSpec(replicas=2), 2)
    assert res.bundles() == [{"CPU": 3.0, "memory": 2 * mib}] and res.strategy == "STRICT_PACK" and res.cpus == 3.0
    assert res.describe() == "2 replicas x 1 CPU + 1 CPU for reading and writing"
    res = reservation(JobSpec(replicas=4, num_workers=2, num_gpus=1, num_cpus=1, memory=1 << 30), 4)
    assert (
        res.bundles() == [{"CPU": 3.0, "GPU": 2.0, "memory": 2.0 * (1 << 30)}] * 2 and res.strategy == "STRICT_SPREAD"
    )
    assert res.describe() == (
        "4 replicas x 1 CPU + 1 GPU over 2 nodes (2/2) + 1 CPU for reading and writing on each node"
    )
    # each node's bundle holds exactly its replicas' memory: its spare CPU can never take a third replica
    assert (
        reservation(JobSpec(replicas=4, num_workers=2, num_cpus=0.5), 4).bundles()
        == [{"CPU": 2.0, "memory": 2 * mib}] * 2
    )


def test_the_largest_reservation_that_fits_what_is_free_now():
    job = JobSpec(replicas=2)
    assert largest_fit(job, [{"CPU": 2.0}]).replicas == 1  # 2 x 1 + 1 does not fit 2 CPUs
    assert largest_fit(job, [{"CPU": 4.0, "memory": 1e9}]).replicas == 2
    assert largest_fit(job, [{"CPU": 4.0}], cap=1).replicas == 1  # a smaller try after losing a race
    assert largest_fit(job, [{"CPU": 1.5}]) is None  # wait for the minimum
    spread_job = JobSpec(replicas=4, num_workers=2)
    assert largest_fit(spread_job, [{"CPU": 2.0}, {"CPU": 2.0}]).per_node == (1, 1)
    assert largest_fit(spread_job, [{"CPU": 3.0}, {"CPU": 3.0}]).per_node == (2, 2)
    assert largest_fit(spread_job, [{"CPU": 8.0}]) is None  # one node cannot hold a spread job
    assert fits(reservation(JobSpec(num_gpus=1, num_cpus=0.5), 1), [{"CPU": 8.0}, {"CPU": 1.5, "GPU": 1.0}])
    assert not fits(reservation(JobSpec(num_gpus=1, num_cpus=0.5), 1), [{"CPU": 8.0}, {"CPU": 1.0, "GPU": 1.0}])


def test_a_cluster_that_could_never_hold_the_minimum_fails_at_once_saying_what_to_change():
    with pytest.raises(ResourceError, match=r"has 1 node\(s\) \(2 CPU\) .* lower JobSpec.num_workers to 1") as exc:
        check_ever_fits(JobSpec(replicas=2, num_workers=2), [{"CPU": 2.0}])
    assert exc.value.permanent
    with pytest.raises(ResourceError, match=r"minimum, 1 replica x 1 GPU \+ 1 CPU .* on a GPU cluster"):
        check_ever_fits(JobSpec(num_cpus=0, num_gpus=1), [{"CPU": 2.0, "GPU": 0.0}])
    with pytest.raises(ResourceError, match=r"1 replica x 4 CPU \+ 1 CPU .* lower JobSpec.num_cpus"):
        check_ever_fits(JobSpec(num_cpus=4), [{"CPU": 2.0}, {"CPU": 2.0}])
    assert check_ever_fits(JobSpec(replicas=8), [{"CPU": 2.0}]).replicas == 1
    assert cluster_summary([{"CPU": 0.5}], [{"CPU": 2.0}]) == "0.5 of 2 CPU free"
    assert cluster_summary([{"CPU": 1, "GPU": 0}, {"CPU": 2, "GPU": 1}], [{"CPU": 2, "GPU": 1}] * 2) == (
        "3 of 4 CPU and 1 of 2 GPU free on 2 nodes"
    )


def test_the_pool_autoscales_within_what_was_reserved_and_says_why_it_is_smaller():
    job = JobSpec(replicas=3)
    pool = size_actor_pool(job, reservation(job, 1))
    assert (pool["min_replicas"], pool["replicas"], pool["io_cpus"], pool["reserved_cpus"]) == (1, 1, 0.25, 2.0)
    assert pool["threads"] == 2 and pool["device"] == "cpu"  # one replica uses its node's share
    assert pool["notes"] == [
        "replicas=3 asked for, 1 reserved: the cluster had room for no more beside its other jobs "
        "(1 replica x 1 CPU + 1 CPU for reading and writing)"
    ]
    pool = size_actor_pool(job, reservation(job, 3))
    assert pool["replicas"] == 3 and pool["threads"] == 1 and not pool["notes"]
    gpu = JobSpec(replicas=4, num_workers=2, num_gpus=1)
    pool = size_actor_pool(gpu, reservation(gpu, 4))
    assert (pool["device"], pool["min_replicas"], pool["num_workers"], pool["reserved_gpus"]) == ("cuda", 2, 2, 4.0)


def test_the_manifest_records_the_pool_and_where_its_replicas_ran(tmp_path):
    from airflow_provider_batchinfer.contract import Manifest
    from airflow_provider_batchinfer.runtime.output.commit import pool_record
    from airflow_provider_batchinfer.runtime.output.parts import replicas_per_node
    from tests.runs import manifest_for

    job = JobSpec(replicas=3, num_workers=2)
    placements = replicas_per_node([("a1", "n-b", "10.0.0.2"), ("a2", "n-a", "10.0.0.1"), ("a3", "n-b", "10.0.0.2")])
    assert placements == [
        {"node_id": "n-b", "node_ip": "10.0.0.2", "replicas": 2},
        {"node_id": "n-a", "node_ip": "10.0.0.1", "replicas": 1},
    ]
    record = pool_record(size_actor_pool(job, reservation(job, 3)), placements, waited_s=12.3456)
    manifest = manifest_for(tmp_path, ())
    manifest = Manifest.from_dict(
        {**manifest.to_dict(), "job": {**manifest.to_dict()["job"], "pool": record.to_dict()}}
    )
    assert manifest.job.pool == record
    assert manifest.to_dict()["job"]["pool"] == {
        "min_replicas": 2,
        "max_replicas": 3,
        "num_workers": 2,
        "reserved": {"cpus": 5.0, "gpus": 0.0},
        "waited_s": 12.346,
        "nodes": placements,
        "in_driver": False,
    }
    assert "pool" not in manifest_for(tmp_path, ()).to_dict()["job"]  # older runtimes: the key is absent
    with pytest.raises(Exception, match=r"_SUCCESS.job.pool.nodes\[0\] has no 'replicas'"):
        Manifest.from_dict(
            {
                **manifest.to_dict(),
                "job": {**manifest.to_dict()["job"], "pool": {**record.to_dict(), "nodes": [{"node_id": "x"}]}},
            }
        )


def test_a_replica_given_a_gpu_that_cuda_cannot_see_fails_saying_so():
    import ray

    from airflow_provider_batchinfer.runtime.model.replica import NoCudaError, check_cuda

    check_cuda(1, ("a", "node", "10.0.0.1"), cuda_available=True)
    with pytest.raises(
        NoCudaError,
        match=r"replica on Ray node 10.0.0.1 \(node\) was given 1 GPU\(s\) by Ray .* "
        r"but torch.cuda.is_available\(\) is False there, so the model was not loaded",
    ) as exc:
        check_cuda(1, ("a", "node", "10.0.0.1"), cuda_available=False)
    assert exc.value.permanent
    # outside a replica the message goes without Ray's GPU ids: asking Ray for them would have
    # attached this process to a cluster (ray.get_gpu_ids() starts ray.init())
    assert not ray.is_initialized() and "GPU ids none" in str(exc.value)
    # Ray hands the driver an ActorDiedError that carries it as text; the driver restores it
    from airflow_provider_batchinfer.runtime.model.replica import replica_init_error

    restored = replica_init_error(
        RuntimeError(f"ActorDiedError: The actor died ...\n{type(exc.value).__module__}.NoCudaError: {exc.value}\n")
    )
    assert isinstance(restored, NoCudaError) and str(restored) == str(exc.value) and restored.permanent
    assert replica_init_error(RuntimeError("ActorDiedError: out of memory")) is None


# --- real jobs on the session's 2-CPU cluster ---------------------------------------------------------


def _job(tmp_path: Path, registry, model, name: str, rows: int = 200, **spec) -> tuple[Path, str]:
    run_dir, job = ticket_job(tmp_path, registry, model, name, rows, **spec)
    return run_dir, write_job_file(job)


def _runtime(spec: str) -> subprocess.Popen:
    # unbuffered, as the local launcher starts it: a test reads its lines as they come
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", spec],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _ids(run_dir: Path, manifest: dict) -> list[int]:
    return sorted(pq.read_table([str(run_dir / f["name"]) for f in manifest["files"]]).column("ticket_id").to_pylist())


@pytest.fixture
def slow_model(registry):
    return registry.log_model("slow_length", "v1", "python", python_class=SlowLength, signature=SIGNATURE)


HOLD_CPUS = textwrap.dedent("""
    import sys, time, ray
    from ray.util.placement_group import placement_group
    ray.init(address=sys.argv[1], logging_level="ERROR")
    group = placement_group([{"CPU": float(sys.argv[2])}])
    assert group.wait(120), "could not hold the cluster's CPUs"
    print("held", flush=True)
    time.sleep(600)
""")


@contextmanager
def _holding_cpus(address: str, cpus: int) -> Iterator[Callable[[], None]]:
    """Another driver holds ``cpus`` CPUs of the cluster (one placement group) until the function
    yielded here is called or the block ends; it is killed either way."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CPUS, address, str(cpus)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def release() -> None:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()

    def wait_until_held() -> None:
        for line in holder.stdout:
            if line.strip() == "held":
                ready.set()
                return

    try:
        ready = threading.Event()
        threading.Thread(target=wait_until_held, daemon=True).start()
        assert ready.wait(180), "the test could not hold the cluster's CPUs"
        yield release
    finally:
        release()


class _Output:
    """A runtime's output, read line by line as it comes. ``found(timeout)``: whether a line held
    ``text`` before the output ended (or ``timeout`` passed)."""

    def __init__(self, proc: subprocess.Popen, text: str) -> None:
        self.lines: list[str] = []
        self._text, self._seen, self._settled = text, False, threading.Event()
        self._reader = threading.Thread(target=self._read, args=(proc,))
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)
            if self._text in line:
                self._seen = True
                self._settled.set()
        self._settled.set()

    def found(self, timeout: float) -> bool:
        self._settled.wait(timeout)
        return self._seen

    def text(self) -> str:
        self._reader.join()
        return "".join(self.lines)


WAITING = "[batchinfer] resources: waiting for 1 replica x 1 CPU + 1 CPU"


@pytest.mark.timeout(900)
def test_jobs_waiting_at_once_on_a_full_2_cpu_cluster_take_turns_and_each_commit_exactly_once(
    ray_cluster, registry, text_length_model, tmp_path
):
    """Two jobs ask for 2 replicas while another driver holds the cluster's 2 CPUs: each waits in
    line (logging it) with one pending reservation. Once the CPUs are free the cluster holds one job's
    1 replica + 1 CPU of I/O at a time: they take turns instead of each holding a replica and starving
    the other's I/O, and each commits every row exactly once."""
    jobs = [_job(tmp_path, registry, text_length_model, f"c{i}", replicas=2) for i in range(2)]
    with _holding_cpus(ray_cluster["address"], 2) as release:
        procs = [_runtime(spec) for _, spec in jobs]
        try:
            outputs = [_Output(proc, WAITING) for proc in procs]
            for proc, output in zip(procs, outputs, strict=True):  # both in line at once, behind the holder
                if not output.found(timeout=300):
                    os.killpg(proc.pid, signal.SIGKILL)
                    pytest.fail(f"the job never waited in line:\n{output.text()[-4000:]}")
            release()
            for proc in procs:
                proc.wait(timeout=600)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    pools = []
    for (run_dir, _), proc, output in zip(jobs, procs, outputs, strict=True):
        out = output.text()
        assert proc.returncode == 0, out[-4000:]
        manifest = committed_manifest(str(run_dir))
        assert manifest["counts"] == {"input_rows": 200, "output_rows": 200, "error_rows": 0}
        assert _ids(run_dir, manifest) == list(range(200))  # every row exactly once
        pool = manifest["job"]["pool"]
        assert (pool["max_replicas"], pool["min_replicas"], pool["reserved"]["cpus"]) == (1, 1, 2.0)
        assert sum(n["replicas"] for n in pool["nodes"]) >= 1 and pool["waited_s"] > 0
        assert "[batchinfer] actor pool: 1.." in out and "[batchinfer] replicas ran: " in out
        pools.append((pool["max_replicas"], pool["reserved"]["cpus"], pool["waited_s"]))
    print(f"pools (max replicas, reserved CPUs, waited s): {pools}")


@pytest.mark.timeout(600)
def test_a_job_that_cannot_get_its_minimum_fails_after_resource_wait_s_naming_what_it_waited_for(
    ray_cluster, registry, slow_model, tmp_path
):
    with _holding_cpus(ray_cluster["address"], 2):
        run_dir, spec = _job(tmp_path, registry, slow_model, "w", resource_wait_s=5)
        proc = _runtime(spec)
        out = proc.communicate(timeout=300)[0]
    failure = last_failure(out)
    assert proc.returncode != 0 and isinstance(failure, JobFailure), out[-4000:]
    assert re.match(
        r"ResourceError: gave up after [5-9]s waiting for 1 replica x 1 CPU \+ 1 CPU for reading and writing "
        r"\(the job's minimum\); the Ray cluster has 0 of 2 CPU free: other jobs hold the rest\.",
        failure.error,
    ), failure.error
    assert "raise JobSpec.resource_wait_s (now 5)" in failure.error and not failure.permanent
    assert "[batchinfer] resources: waiting for 1 replica x 1 CPU + 1 CPU for reading and writing; " in out
    assert not (run_dir / SUCCESS_MARKER).exists()
    assert sorted(p.name for p in run_dir.iterdir() if p.name != "_claims") == [
        JOB_SPEC_FILE
    ]  # nothing written, nothing committed


def test_read_and_write_tasks_run_one_per_replica_and_at_least_two():
    """Ray would start up to eight read workers per two CPUs at 0.25 CPU each; their start-ups
    crowd the replicas' own on a small machine."""
    from airflow_provider_batchinfer.runtime.planning.pipeline import io_tasks

    for replicas, tasks in ((1, 2), (2, 2), (5, 5)):
        job = JobSpec(replicas=replicas)
        assert io_tasks(size_actor_pool(job, reservation(job, replicas))) == tasks
