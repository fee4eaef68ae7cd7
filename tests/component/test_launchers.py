"""The launcher interface: the registry, the local launcher against real subprocesses that print
the runtime's last line, the Ray version check, and what ray_jobs derives from a connection."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import threading
import time

import pytest

from airflow_provider_batchinfer.contract import JobFailure, JobFile, JobResult, ModelRef, RunOwner
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec
from airflow_provider_batchinfer.launchers import LAUNCHER_NAMES, LAUNCHERS, launcher_class
from airflow_provider_batchinfer.launchers.base import FAILED, SUCCEEDED, TIMEOUT, Launcher, LaunchError
from airflow_provider_batchinfer.launchers.local import LocalLauncher, check_ray_version, cluster_ray_version
from airflow_provider_batchinfer.triggers.base import job_trigger

LOG = logging.getLogger("test_launchers")
OWNER = RunOwner(dag_id="d", task_id="t", run_id="manual__1", try_number=2, map_index=-1)


def _job(tmp_path) -> JobFile:
    return JobFile(
        job_id="batchinfer-d-t-t02abc",
        attempt="t02abc",
        launcher="local",
        run_dir=str(tmp_path / "out"),
        input_locations=(str(tmp_path / "in"),),
        input_spec=InputSpec(),
        job_spec=JobSpec(),
        model=ModelRef("m", "v1", "python", "0" * 64, str(tmp_path / "m")),
        registry_root=str(tmp_path),
        airflow=OWNER,
    )


class ScriptLauncher(LocalLauncher):
    """The local launcher with a tiny script in place of the runtime: a real subprocess all the same."""

    def __init__(self, script: str, **kwargs: object) -> None:
        kwargs.setdefault("ray_address", "local")  # these scripts need no Ray: never the embedded one
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.script = textwrap.dedent(script)

    def command(self, job_location: str) -> list[str]:
        return [sys.executable, "-c", self.script, job_location]


def _run(launcher: LocalLauncher, tmp_path, timeout: float | None = None):
    lines: list[str] = []
    handle = launcher.start(_job(tmp_path), str(tmp_path / "_job.json"), LOG)
    assert launcher.poll(handle) is None  # the local launcher's outcome comes from wait()
    return handle, launcher.wait(handle, lines.append, poll_interval=0.1, timeout=timeout), lines


def test_the_registry_knows_both_launchers_by_their_connection_value():
    assert LAUNCHER_NAMES == ("local", "ray_jobs")
    for name in LAUNCHERS:
        cls = launcher_class(name)
        assert issubclass(cls, Launcher) and cls.name == name
    assert launcher_class("ray_jobs").deferrable and not launcher_class("local").deferrable
    with pytest.raises(ValueError, match=r"launcher 'k8s' is not available; use one of \('local', 'ray_jobs'\)"):
        launcher_class("k8s")


def test_local_success_forwards_log_lines_and_reads_the_result_line(tmp_path):
    result = JobResult(rows=10, files=1).to_line()
    launcher = ScriptLauncher(f"""
        import sys
        print("scored 10 rows from", sys.argv[1])
        print({result!r})
    """)
    handle, outcome, lines = _run(launcher, tmp_path)
    assert handle.job_id == "batchinfer-d-t-t02abc" and handle.attempt == "t02abc" and handle.url is None
    assert outcome.succeeded and outcome.status == SUCCEEDED and outcome.failure is None
    assert lines == [f"scored 10 rows from {tmp_path / '_job.json'}"]  # the result line is not a log line


@pytest.mark.parametrize("permanent", [True, False])
def test_local_failure_carries_the_runtime_error_and_whether_a_retry_helps(tmp_path, permanent):
    failure = JobFailure(error="PermissionError: access denied", type="PermissionError", permanent=permanent)
    launcher = ScriptLauncher(f"""
        import sys
        print("starting")
        print({failure.to_line()!r})
        sys.exit(1)
    """)
    _, outcome, lines = _run(launcher, tmp_path)
    assert outcome.status == FAILED and outcome.failure == failure and outcome.permanent is permanent
    assert outcome.message == "batch inference job batchinfer-d-t-t02abc failed: PermissionError: access denied"
    assert lines == ["starting", "PermissionError: access denied"]


def test_local_exit_without_a_result_quotes_the_last_output(tmp_path):
    launcher = ScriptLauncher("""
        import sys
        print("Traceback: something broke")
        sys.exit(3)
    """)
    _, outcome, _ = _run(launcher, tmp_path)
    assert not outcome.succeeded and not outcome.permanent
    assert "exited with code 3 without a result; last output:\nTraceback: something broke" in outcome.message


def test_the_runtime_learns_the_task_process_pid_for_its_watchdog(tmp_path):
    launcher = ScriptLauncher("""
        import os
        print(os.environ["BATCHINFER_PARENT_PID"], os.getppid(), os.getpgrp() == os.getpid())
    """)
    _, _, lines = _run(launcher, tmp_path)
    assert lines == [f"{os.getpid()} {os.getpid()} True"]  # our pid, its parent, its own process group


def test_local_zero_exit_without_a_result_line_is_not_a_success(tmp_path):
    _, outcome, _ = _run(ScriptLauncher("print('done?')"), tmp_path)
    assert not outcome.succeeded and "without a result" in outcome.message


def test_local_job_past_its_timeout_is_stopped(tmp_path):
    launcher = ScriptLauncher(
        """
        import time
        print("working", flush=True)
        time.sleep(60)
    """,
        kill_grace_s=5,
    )
    started = time.monotonic()
    _, outcome, lines = _run(launcher, tmp_path, timeout=1.0)
    assert outcome.status == TIMEOUT and time.monotonic() - started < 30
    assert "ran past job_timeout=1.0s and was stopped; nothing was committed" in outcome.message
    assert lines == ["working"]


def test_local_stop_ends_the_whole_process_group(tmp_path):
    launcher = ScriptLauncher(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    """,
        kill_grace_s=5,
    )
    handle = launcher.start(_job(tmp_path), "unused", LOG)
    lines: list[str] = []
    waiter = threading.Thread(target=lambda: lines.append(launcher.wait(handle, lines.append)))  # type: ignore[arg-type]
    waiter.start()
    deadline = time.monotonic() + 20
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launcher.stop(handle) is True
    waiter.join(timeout=20)
    child = int(lines[0])
    outcome = lines[-1]
    assert not outcome.succeeded  # type: ignore[attr-defined]
    assert _gone(child), "the job's child process outlived stop()"
    assert launcher.stop(handle) is False  # nothing left to stop


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    """The process ended (absent, or a zombie nobody reaped yet)."""
    from pathlib import Path

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_local_launcher_cannot_defer(tmp_path):
    launcher = LocalLauncher()
    with pytest.raises(NotImplementedError, match="the local launcher cannot defer"):
        job_trigger(launcher, launcher.attach("j", "a", LOG), conn_id="c", poll_interval=1, deadline=None)
    assert launcher.job_name(OWNER) is None and launcher.existing_job(OWNER) is None
    assert LocalLauncher(ray_address="127.0.0.1:6379").job_ray_address == "127.0.0.1:6379"


def test_a_cluster_on_another_ray_version_is_refused_with_what_to_do():
    check_ray_version("10.0.0.5:6379", "2.60.0", "2.60.0")  # same: fine
    check_ray_version("10.0.0.5:6379", None, "2.60.0")  # unknown: ray.init decides
    with pytest.raises(LaunchError) as info:
        check_ray_version("10.0.0.5:6379", "2.51.1", "2.60.0")
    assert info.value.permanent
    assert str(info.value).startswith(
        "the Ray cluster at 10.0.0.5:6379 runs Ray 2.51.1, but this Airflow worker has Ray 2.60.0"
    )
    assert "Install ray==2.51.1 on the worker" in str(info.value)


def test_the_version_probe_skips_addresses_it_cannot_read():
    assert cluster_ray_version("ray://head:10001", {}) is None
    assert cluster_ray_version("auto", {}) is None


def test_a_mismatch_fails_the_start_before_any_subprocess(tmp_path, monkeypatch):
    import airflow_provider_batchinfer.launchers.local as local

    monkeypatch.setattr(local, "cluster_ray_version", lambda address, env, timeout_s=30.0: "1.0.0")
    launcher = ScriptLauncher("raise SystemExit('must not run')", ray_address="127.0.0.1:6379")
    with pytest.raises(LaunchError, match="runs Ray 1.0.0"):
        launcher.start(_job(tmp_path), "unused", LOG)
    assert launcher._proc is None


def test_ray_jobs_from_a_connection(tmp_path):
    from airflow_provider_batchinfer.hooks.service_config import ServiceConfig
    from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher, submission_id_for
    from airflow_provider_batchinfer.triggers.ray_job import RayJobTrigger

    config = ServiceConfig(
        stage_root="/s",
        registry_root="/r",
        launcher="ray_jobs",
        ray_address="http://head:8265",
        runtime_env={"pip": ["x"]},
        python="/opt/py",
        storage_options={"access_key": "AK", "secret_key": "SK"},
        ray_headers={"Authorization": "Bearer tok"},
    )
    launcher = RayJobsLauncher.from_config(config)
    assert launcher.headers == {"Authorization": "Bearer tok"} and launcher.python == "/opt/py"
    assert launcher.runtime_env == {"pip": ["x"]}  # the keys stay here: a job gets a session derived from them
    # one id per submission (Ray never takes one twice): the identity's first 128 bits and the attempt
    assert launcher.job_name(OWNER, "t02abc", "f" * 64) == submission_id_for(OWNER, "t02abc", "f" * 64)
    assert submission_id_for(OWNER, "t02abc", "f" * 64) == f"batchinfer-d-t-{'f' * 32}-t02abc"
    assert launcher.job_ray_address is None  # a Jobs API driver finds its cluster by itself
    handle = launcher.attach("sid", "t02abc", LOG)
    assert handle.url == "http://head:8265/#/jobs/sid"
    trigger = job_trigger(launcher, handle, conn_id="c", poll_interval=2, deadline=None)
    assert isinstance(trigger, RayJobTrigger)
    assert trigger.serialize()[1] == {
        "submission_id": "sid",
        "log_offset": 0,
        "model_service_conn_id": "c",
        "poll_interval": 2.0,
        "deadline": None,
    }
    assert RayJobsLauncher.check_address("head:8265", "c") == "http://head:8265"
    with pytest.raises(ValueError, match="needs the Ray dashboard address"):
        RayJobsLauncher.check_address(None, "c")


def test_free_ports_are_distinct_even_when_many_are_asked_for():
    """The embedded Ray's nine ports: one at a time the kernel can hand out one twice, and Ray then
    refuses to start; ``free_ports`` holds every socket until all are picked."""
    from airflow_provider_batchinfer.launchers.embedded.procs import free_ports

    ports = free_ports(64)
    assert len(ports) == len(set(ports)) == 64 and all(1024 < p < 65536 for p in ports)
