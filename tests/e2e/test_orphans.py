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

from airflow_provider_batchinfer.launchers import warm_runtime
from airflow_provider_batchinfer.launchers.local import LocalLauncher
from airflow_provider_batchinfer.stage import JOB_SPEC_FILE, SUCCESS_MARKER
from tests.conftest import REPO
from tests.models import SlowLength, write_tickets

SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}

# The task process: the test DAG's inference task run by dag.test() in this interpreter (the session's
# migrated metadata DB; the pytest process does not write to it meanwhile).
TASK = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
bag.get_dag("bi_test_error_mode").test(run_conf=json.loads(sys.argv[2]))
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


def _gone(proc: psutil.Process, wait_s: float) -> bool:
    try:
        proc.wait(timeout=wait_s)
    except psutil.TimeoutExpired:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    return True


def _kill_the_task_process_mid_job(
    registry, tmp_path, rows: int, scoring: str, warm: bool = False, pool: bool = False, **extra_env: str
) -> None:
    """Run the test DAG's task in its own process on the embedded default (RAY_ADDRESS removed),
    SIGKILL that process once the job's log shows ``scoring``, and check that the runtime ends
    within 30 s and no _SUCCESS appears (for a pool job, even after its normal run: its Ray
    workers could outlive it). ``warm``: a spare runtime process waits for the job
    (launchers/warm_runtime.py), else none may take it."""
    registry.log_model("slow_length", "v1", "python", python_class=SlowLength, signature=SIGNATURE)
    data = write_tickets(tmp_path / "in", rows=rows, files=3)
    out = tmp_path / "out"
    conf = {"input": str(data), "out": str(out), "model": "slow_length"}
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
            [sys.executable, "-c", textwrap.dedent(TASK), str(REPO / "tests" / "dags"), json.dumps(conf)],
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
        killed_at = time.monotonic()
        os.kill(task.pid, signal.SIGKILL)  # the task process: no on_kill, no cleanup
        assert _gone(runtime, 30), "the job outlived its task process by 30 s"
        print(f"runtime ended {time.monotonic() - killed_at:.1f}s after the kill")
        if pool:  # past the job's normal scoring: a surviving Ray worker of the job would have written
            time.sleep(rows / 100 * 0.5 + 5)
        assert not (out / SUCCESS_MARKER).exists()  # the commit is the runtime's own, and it is gone
    finally:
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
        task.wait()


@pytest.mark.usefixtures("airflow_db")
def test_kill_9_of_the_task_process_ends_its_job_and_nothing_commits(registry, tmp_path):
    """An actor-pool job (1,500 rows: 15 model calls of 0.5 s, ~8 s of scoring)."""
    _kill_the_task_process_mid_job(
        registry,
        tmp_path,
        rows=1500,
        scoring="progress:",
        pool=True,
        BATCHINFER_IN_DRIVER_MAX_ROWS="0",  # the pool, not the driver
    )


@pytest.mark.usefixtures("airflow_db")
def test_kill_9_of_the_task_process_ends_a_job_scored_in_the_driver(registry, tmp_path):
    """A job scored in the driver process (1,000 rows: 10 model calls of 0.5 s) dies with it too."""
    _kill_the_task_process_mid_job(registry, tmp_path, rows=1000, scoring="rows in the driver process")


@pytest.mark.usefixtures("airflow_db")
def test_kill_9_of_the_task_process_ends_a_job_in_a_warm_runtime_process(registry, tmp_path):
    """The same job handed to a spare that was waiting for it: not the task's child, ended all the same."""
    _kill_the_task_process_mid_job(registry, tmp_path, rows=1000, scoring="rows in the driver process", warm=True)


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
