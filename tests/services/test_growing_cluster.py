"""A cluster that grows on demand (an autoscaler, or an operator adding nodes): a job that starts
while no node could hold its minimum waits, saying what for, and runs on the node that joins.

The cluster is real and on loopback: a head with no CPU (``ray start --head --num-cpus=0``, the
shape of an autoscaling cluster's head), then, once the job's log says it is waiting, a worker
joined with ``ray start --address``. Each node has its own loopback address, temp dir and ports,
as in ``tests/conftest.py``'s two-node cluster, and is stopped by its process group (never ``ray
stop``, which would stop every Ray on the machine)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_batchinfer.launchers.embedded.procs import free_ports
from tests.models import TextLength, committed_manifest, ticket_job, write_job_file

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
# Not 127.0.0.1 (Ray swaps that for the machine's own address once a second node joins) and not the
# two-node cluster's 127.0.0.2/3: each node is its own loopback host
HEAD_IP, WORKER_IP = "127.0.0.4", "127.0.0.5"
READY_LINE = "Ray runtime started"
WAITING = "[batchinfer] resources: waiting for "


class RayNode:
    """One ``ray start --block`` node in its own process group and temp dir, its log in ``log``."""

    def __init__(self, name: str, node_ip: str, args: list[str], root: Path) -> None:
        manager, objects, agent, agent_grpc, metrics, runtime_env = free_ports(6)
        self.temp_dir = tempfile.mkdtemp(prefix="raygrow-", dir="/tmp")  # short: Ray's socket paths live below
        self.log = root / f"{name}.log"
        env = dict(
            os.environ,
            RAY_AUTH_MODE="token",
            BATCHINFER_MODEL_CACHE=str(root / f"cache-{name}"),
            # the session turns multi-node clusters off for every other test; this one is one on purpose
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",
        )
        env.pop("RAY_ADDRESS", None)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "ray"),
                    "start",
                    "--block",
                    *args,
                    "--disable-usage-stats",
                    f"--node-ip-address={node_ip}",
                    f"--node-manager-port={manager}",
                    f"--object-manager-port={objects}",
                    f"--dashboard-agent-listen-port={agent}",
                    f"--dashboard-agent-grpc-port={agent_grpc}",
                    f"--metrics-export-port={metrics}",
                    f"--runtime-env-agent-port={runtime_env}",
                    f"--temp-dir={self.temp_dir}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while READY_LINE not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.log.stem} did not come up (exit {self.proc.poll()}):\n{self.tail()}")
            time.sleep(0.2)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """The whole group at once: the job is over, so nothing is left to drain."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ensure_auth_token() -> None:
    """``~/.ray/auth_token``, which token auth needs (created under the lock the suite's clusters use)."""
    import fcntl

    lock_path = Path.home() / ".ray" / ".auth_token.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            [str(Path(sys.executable).parent / "ray"), "get-auth-token", "--generate"],
            check=True,
            capture_output=True,
            env=dict(os.environ, RAY_AUTH_MODE="token"),
        )


@pytest.fixture
def nodes(tmp_path):
    """Starts nodes for a test (``nodes(name, ip, args)``) and stops every one of them after it."""
    started: list[RayNode] = []

    def start(name: str, node_ip: str, args: list[str]) -> RayNode:
        started.append(RayNode(name, node_ip, args, tmp_path))
        return started[-1]

    yield start
    for node in reversed(started):
        node.stop()


def _join_worker(nodes, address: str) -> RayNode:
    """A worker with 2 CPUs joined to ``address``; up to three starts, each on fresh ports: on a loaded
    2-core machine a worker's raylet can miss Ray's own registration deadline (as in conftest's
    two-node cluster), and the head it joins is still up."""
    errors = []
    for attempt in range(3):
        worker = nodes(f"worker-{attempt}", WORKER_IP, [f"--address={address}", "--num-cpus=2"])
        try:
            worker.wait_ready()
            return worker
        except RuntimeError as exc:
            errors.append(str(exc))
            worker.stop()
    raise RuntimeError("no worker joined in 3 starts:\n" + "\n\n".join(errors))


def _runtime(spec: str, address: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"}
    env.update(PYTHONUNBUFFERED="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
    return subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", spec],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def test_a_job_waits_for_a_node_that_can_hold_it_and_runs_on_it_once_it_joins(registry, nodes, tmp_path):
    """The head has no CPU, so no node of the cluster as it is could hold one replica: the job waits
    on its placement group (the demand an autoscaler adds a node for) instead of failing, and the
    replica runs on the worker that joins."""
    _ensure_auth_token()
    port, client_port = free_ports(2)
    address = f"{HEAD_IP}:{port}"
    head = nodes(
        "head",
        HEAD_IP,
        [
            "--head",
            f"--port={port}",
            "--num-cpus=0",
            "--include-dashboard=false",
            f"--ray-client-server-port={client_port}",
        ],
    )
    model = registry.log_model("text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE)
    run_dir, job = ticket_job(
        tmp_path, registry, model, "grow", 40, ray_address=address, in_driver_max_rows=0, resource_wait_s=120
    )
    spec = write_job_file(job)
    head.wait_ready()
    proc = _runtime(spec, address)
    lines: list[str] = []
    waiting = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if WAITING in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not waiting.wait(0.5):
            assert proc.poll() is None or reader.is_alive(), "".join(lines)[-5000:]
        _join_worker(nodes, address)
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=30)
    out = "".join(lines)
    assert rc == 0, out[-5000:]
    said = next(line for line in lines if WAITING in line)
    assert said.startswith(f"{WAITING}1 replica x 1 CPU + 1 CPU for reading and writing; "), said
    assert "the cluster has 0 of 0 CPU free, and its 1 node(s) (0 CPU) could never hold that: " in said, said
    assert "waiting for nodes that can to join" in said and "JobSpec.resource_wait_s=120" in said, said
    manifest = committed_manifest(str(run_dir))
    assert manifest is not None and manifest["counts"] == {"input_rows": 40, "output_rows": 40, "error_rows": 0}
    pool = manifest["job"]["pool"]
    assert [(n["node_ip"], n["replicas"]) for n in pool["nodes"]] == [(WORKER_IP, 1)], pool
    assert pool["waited_s"] > 0
