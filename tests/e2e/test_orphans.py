"""No orphans: a ``local`` job dies with its Airflow task process. The runtime's watchdog
(runtime/watchdog.py) sees ``BATCHINFER_PARENT_PID`` gone and kills its own process group, so a task
killed by the OOM killer or a lost worker never leaves a job that commits ``_SUCCESS`` later."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from unittest import mock

import psutil
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER
from airflow_provider_batchinfer.launchers.embedded import embedded_ray, warm_runtime
from airflow_provider_batchinfer.launchers.local import LocalLauncher
from tests.conftest import REPO
from tests.e2e import test_reattach
from tests.e2e.test_reattach import gated_tickets

# a model whose job runs until its gate is opened (the re-attach tests'): here it never is while
# the test runs, so the job is mid-scoring whenever its task process is killed
gated_model, gate = test_reattach.gated_model, test_reattach.gate

# The task process: the operator's execute, as an Airflow worker's task process runs it, on the
# embedded default (no connection, no Ray address); its log on stdout.
TASK = """
import json, sys
from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec
from tests.task_context import TaskInstanceStandIn
args = json.loads(sys.argv[1])
BatchInferenceOperator(
    task_id="infer", model="gated_length", version="v1", input=args["input"],
    output_spec=OutputSpec(stage_location=args["out"]), job_spec=JobSpec(max_batch_rows=100, progress_interval_s=2),
).execute({"ti": TaskInstanceStandIn()})
"""


def _runtime_of(out: Path, log: str) -> psutil.Process | None:
    """The job's runtime process: started for it (its command line names the job file), or the warm
    spare it was handed to (the task log names that process)."""
    warm = re.search(r"in warm runtime process (\d+)", log)
    if warm:
        return psutil.Process(int(warm.group(1)))
    spec = str(out / JOB_SPEC_FILE)
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "airflow_provider_batchinfer.runtime" in cmd and spec in cmd:
            return proc
    return None


def _replicas() -> list[psutil.Process]:
    """The pool's actors (Ray Data's ``MapWorker``, which load and call the model) on this session's
    embedded Ray: workers of its raylet, the only node."""
    state = embedded_ray.read_state(embedded_ray.state_dir())
    assert state is not None, "no embedded Ray runs"
    group = [p for p in psutil.process_iter(["name"]) if _pgid(p.pid) == state.head_pid]
    raylets = {p.pid for p in group if p.info["name"] == "raylet"}
    replicas = []
    for proc in psutil.process_iter(["ppid", "cmdline"]):
        if proc.info["ppid"] in raylets and (proc.info["cmdline"] or [""])[0].startswith("ray::MapWorker"):
            replicas.append(proc)
    return replicas


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _gone(proc: psutil.Process, wait_s: float) -> bool:
    try:
        proc.wait(timeout=wait_s)
    except psutil.TimeoutExpired:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    return True


def _kill_the_task_process_mid_job(
    tmp_path, gate: Path, scoring: str, warm: bool = False, pool: bool = False, **extra_env: str
) -> None:
    """Run the gated model's job from a task process on the embedded default (RAY_ADDRESS removed),
    SIGKILL that process once the job's log shows ``scoring``, and check that the runtime ends
    within 30 s (for a pool job, its actor then too: no Ray worker scores for it afterwards) and
    that no _SUCCESS appears. ``warm``: a spare runtime process waits for the job
    (launchers/embedded/warm_runtime.py), else none may take it."""
    data = gated_tickets(tmp_path / "in", rows=200, files=2, gate=gate)  # scored once the gate opens: never
    out = tmp_path / "out"
    args = {"input": str(data), "out": str(out)}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra_env)
    env[warm_runtime.ENABLE_ENV] = "1" if warm else "0"
    if warm:  # the spare the task's launcher finds: started from the same environment
        with mock.patch.dict(os.environ, env, clear=True):
            spare = warm_runtime.prestart(LocalLauncher().spare_environment(), "python", None, 120)
            assert spare is not None and warm_runtime.wait_ready(warm_runtime.spares_dir(), 60)
    log_path = tmp_path / "task.log"
    with open(log_path, "w") as log:
        task = subprocess.Popen(
            [sys.executable, "-c", TASK, json.dumps(args)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        runtime = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and task.poll() is None:
            log = log_path.read_text()
            runtime = _runtime_of(out, log) if (out / JOB_SPEC_FILE).exists() else None
            if runtime is not None and scoring in log:  # scoring, not starting
                break
            time.sleep(0.5)
        assert runtime is not None and task.poll() is None, log_path.read_text()[-4000:]
        assert (f"in warm runtime process {runtime.pid}" in log_path.read_text()) == warm
        if not warm:  # a spare is nobody's child; its watchdog watches the task's pid all the same
            parent = runtime.parent()
            assert parent is not None and parent.pid == task.pid == int(runtime.environ()["BATCHINFER_PARENT_PID"])
        replicas = _replicas() if pool else []
        assert bool(replicas) == pool, replicas  # its actor waits at the gate with the first batch
        killed_at = time.monotonic()
        os.kill(task.pid, signal.SIGKILL)  # the task process: no on_kill, no cleanup
        assert _gone(runtime, 30), "the job outlived its task process by 30 s"
        print(f"runtime ended {time.monotonic() - killed_at:.1f}s after the kill")
        # Ray ends the actors of a driver that is gone: none scores or writes for the job afterwards
        assert all(_gone(replica, 60) for replica in replicas), "the pool's actor outlived its job by 60 s"
        assert not (out / SUCCESS_MARKER).exists()  # the commit is the runtime's own, and it is gone
    finally:
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
        task.wait()


@pytest.mark.usefixtures("airflow_db", "gated_model")
def test_kill_9_of_the_task_process_ends_its_job_and_nothing_commits(tmp_path, gate):
    """An actor-pool job."""
    _kill_the_task_process_mid_job(
        tmp_path,
        gate,
        scoring="replica ready on node",  # the pool's actor has the model: its first batch waits at the gate
        pool=True,
        BATCHINFER_IN_DRIVER_MAX_ROWS="0",  # the pool, not the driver
    )


@pytest.mark.usefixtures("airflow_db", "gated_model")
def test_kill_9_of_the_task_process_ends_a_job_scored_in_the_driver(tmp_path, gate):
    """A job scored in the driver process dies with it too."""
    _kill_the_task_process_mid_job(tmp_path, gate, scoring="rows in the driver process")


@pytest.mark.usefixtures("airflow_db", "gated_model")
def test_kill_9_of_the_task_process_ends_a_job_in_a_warm_runtime_process(tmp_path, gate):
    """The same job handed to a spare that was waiting for it: not the task's child, ended all the same."""
    _kill_the_task_process_mid_job(tmp_path, gate, scoring="rows in the driver process", warm=True)


def test_the_watchdog_kills_its_process_group_when_the_parent_goes(tmp_path):
    """The watchdog alone, without Ray: a parent that starts a 'runtime' (a child in its own session
    that arms the watchdog and starts a grandchild) and then dies of SIGKILL."""
    child = textwrap.dedent("""
        import subprocess, sys, time
        from airflow_provider_batchinfer.runtime.watchdog import watch_parent
        watch_parent()
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(grandchild.pid, flush=True)
        time.sleep(120)
        open(sys.argv[1], "w").write("committed")
    """)
    parent = textwrap.dedent("""
        import os, subprocess, sys
        env = dict(os.environ, BATCHINFER_PARENT_PID=str(os.getpid()))
        proc = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        print(proc.pid, proc.stdout.readline().strip(), flush=True)
        proc.wait()
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    marker = tmp_path / "committed"
    task = subprocess.Popen(
        [sys.executable, "-c", parent, child, str(marker)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert task.stdout is not None
    runtime_pid, grandchild_pid = map(int, task.stdout.readline().split())
    runtime, grandchild = psutil.Process(runtime_pid), psutil.Process(grandchild_pid)
    task.kill()
    task.wait()
    assert _gone(runtime, 10) and _gone(grandchild, 10)
    assert not marker.exists()
