"""The embedded default's one warm local Ray (launchers/embedded_ray.py): started by the first job,
reused by later and concurrent jobs, stopped after its idle timeout, replaced when stale. Jobs run
with no Ray address configured (RAY_ADDRESS removed), each test on its own state directory."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_provider_batchinfer.launchers import embedded_ray, state_dirs
from airflow_provider_batchinfer.launchers.base import LaunchError
from airflow_provider_batchinfer.launchers.local import PARENT_PID_ENV, LocalLauncher
from airflow_provider_batchinfer.launchers.procs import proc_alive, proc_start_time
from airflow_provider_batchinfer.specs import JobSpec
from airflow_provider_batchinfer.stage import SUCCESS_MARKER
from tests.conftest import REPO
from tests.models import committed_manifest, write_tickets

LOG = logging.getLogger("test_embedded_ray")
RAY_VERSION = embedded_ray.installed_ray_version() or "unknown"


@pytest.fixture
def ray_dir(monkeypatch):
    """A fresh, short state directory for this test's embedded Ray, stopped at the end; no Ray
    address in the environment, so jobs use the embedded default."""
    directory = Path(tempfile.mkdtemp(prefix="bir-t-", dir="/tmp"))
    monkeypatch.setenv(embedded_ray.DIR_ENV, str(directory))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield directory
    embedded_ray.shutdown(directory)
    shutil.rmtree(directory, ignore_errors=True)


def _starts(directory: Path) -> list[str]:
    history = directory / "history.log"
    return [line for line in history.read_text().splitlines() if " start " in line] if history.exists() else []


def _gone(pid: int, started: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while proc_alive(pid, started) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not proc_alive(pid, started)


# --- settings and leases (no Ray) ----------------------------------------------------------------
def test_state_dir_and_idle_timeout_come_from_the_environment():
    assert embedded_ray.state_dir({}) == Path(f"/tmp/batchinfer-ray-{os.getuid()}")
    assert embedded_ray.state_dir({"BATCHINFER_RAY_DIR": "/tmp/x"}) == Path("/tmp/x")
    assert embedded_ray.idle_seconds(None, {}) == 600.0
    assert embedded_ray.idle_seconds(None, {"BATCHINFER_RAY_IDLE_S": "2.5"}) == 2.5
    assert embedded_ray.idle_seconds(30, {"BATCHINFER_RAY_IDLE_S": "2.5"}) == 30.0  # the parameter wins
    with pytest.raises(LaunchError, match=r"BATCHINFER_RAY_IDLE_S='soon' is not a number of seconds") as info:
        embedded_ray.idle_seconds(None, {"BATCHINFER_RAY_IDLE_S": "soon"})
    assert info.value.permanent
    with pytest.raises(LaunchError, match=r"idle timeout must be >= 0 seconds, got -1"):
        LocalLauncher(idle_s=-1)


def test_a_state_dir_of_another_user_is_passed_over_for_a_private_one(tmp_path, monkeypatch):
    """The launcher's embedded Ray lives in the private fallback; the foreign directory stays empty
    (``tests/component/test_local_trust.py`` attacks the directory itself without starting Ray)."""
    if os.getuid() != 0:
        pytest.skip("needs root to hand a directory to another uid")
    foreign = Path(tempfile.mkdtemp(prefix="bir-theirs-", dir="/tmp"))
    os.chown(foreign, 65534, 65534)
    runtime = Path(tempfile.mkdtemp(prefix="bir-xdg-", dir="/tmp"))
    monkeypatch.setenv(embedded_ray.DIR_ENV, str(foreign))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fallback = runtime / "batchinfer-ray"
    warnings: list[str] = []

    class Log:
        def info(self, msg, *args):
            LOG.info(msg, *args)

        def warning(self, msg, *args):
            warnings.append(msg % args)

        error = warning

    # a job that needs the actor pool: a one-replica job starts no Ray
    on_pool = SimpleNamespace(
        job_id="foreign-dir",
        attempt="t01",
        job_spec=JobSpec(replicas=2),
        model=SimpleNamespace(flavor="python_class"),
        llm_engine=None,
    )
    launcher = LocalLauncher()
    try:
        handle = launcher.start(on_pool, "unused", Log())  # type: ignore[arg-type]
        state = embedded_ray.read_state(fallback)
        assert state is not None and state.auth_mode == "token", state
        assert any(f"state directory {foreign} is not used: {foreign} belongs to uid 65534" in w for w in warnings)
        launcher.wait(handle, LOG.info)  # its job file does not exist: it fails, and gives its lease back
        assert not list((fallback / "leases").iterdir())
        assert os.listdir(foreign) == []
    finally:
        embedded_ray.shutdown(fallback)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(foreign, ignore_errors=True)


def test_leases_of_ended_processes_are_dropped(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    with embedded_ray.locked(tmp_path):
        embedded_ray.add_lease(tmp_path, os.getpid())
        embedded_ray.add_lease(tmp_path, ended.pid)
        (tmp_path / "leases" / "12345678").write_text("1")  # no such pid
        (tmp_path / "leases" / str(os.getppid())).write_text("1")  # a live pid, but another start time
        long_ago = time.time() - 3600  # the leases were taken an hour ago, by jobs that ran since
        os.utime(tmp_path / "last_used", (long_ago, long_ago))
        assert embedded_ray.live_leases(tmp_path) == [os.getpid()]
        # their processes were just seen gone: the idle clock starts now, not at the leases' start
        assert (tmp_path / "last_used").stat().st_mtime > long_ago + 3000
        os.utime(tmp_path / "last_used", (long_ago, long_ago))
        assert embedded_ray.live_leases(tmp_path) == [os.getpid()]  # nothing ended this time
        assert (tmp_path / "last_used").stat().st_mtime == long_ago
    assert sorted(p.name for p in (tmp_path / "leases").iterdir()) == [str(os.getpid())]
    embedded_ray.drop_lease(tmp_path, os.getpid())
    assert not list((tmp_path / "leases").iterdir())


def test_the_keeper_reads_its_idle_clock_after_dropping_ended_leases(tmp_path):
    """What the keeper decides on: a job that ran longer than the idle timeout and has just ended
    leaves a Ray idle for ~0 s, not for as long as the job ran."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    long_ago = time.time() - 3600
    state = embedded_ray.EmbeddedRay(
        address="127.0.0.1:1",
        head_pid=0,
        head_started=0,
        keeper_pid=0,
        temp_dir=str(tmp_path / "ray"),
        ray_version=RAY_VERSION,
        uid=os.getuid(),
        auth_mode="disabled",
        token_path=None,
        idle_s=20.0,
        started_at=long_ago,
    )
    with embedded_ray.locked(tmp_path):
        embedded_ray.add_lease(tmp_path, os.getpid())
        assert embedded_ray.idle_for(tmp_path, state) == 0.0  # a job holds it
        embedded_ray.add_lease(tmp_path, ended.pid)
        (tmp_path / "leases" / str(os.getpid())).unlink()
        os.utime(tmp_path / "last_used", (long_ago, long_ago))  # the ended job's lease: an hour old
        assert embedded_ray.idle_for(tmp_path, state) < 5  # its end was just seen: the clock restarted
        assert not list((tmp_path / "leases").iterdir())
        os.utime(tmp_path / "last_used", (long_ago, long_ago))
        assert embedded_ray.idle_for(tmp_path, state) > 3500  # no lease, nothing ended: idle since then


def test_the_launcher_tells_the_runtime_its_pid(tmp_path):
    launcher = LocalLauncher(ray_address="local")
    assert PARENT_PID_ENV == "BATCHINFER_PARENT_PID"
    from airflow_provider_batchinfer.runtime.watchdog import PARENT_PID_ENV as RUNTIME_SIDE

    assert RUNTIME_SIDE == PARENT_PID_ENV
    assert launcher.environment()["RAY_ADDRESS"] == "local"  # a private Ray per job, on request


# --- a real embedded Ray ------------------------------------------------------------------------------
def test_stale_states_are_replaced(ray_dir):
    # a state whose processes and port are long gone (a reboot, a killed worker): replaced, its temp dir removed
    leftover = Path(state_dirs.make_ray_temp_dir(ray_dir))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ray_dir / "state.json").write_text(
        json.dumps(
            {
                "address": "127.0.0.1:1",
                "head_pid": dead.pid,
                "head_started": 1,
                "keeper_pid": dead.pid,
                "temp_dir": str(leftover),
                "ray_version": RAY_VERSION,
                "uid": os.getuid(),
                "auth_mode": "token",
                "token_path": None,
                "idle_s": 600.0,
                "started_at": 0.0,
            }
        )
    )
    with embedded_ray.locked(ray_dir):  # a worker's RAY_AUTH_MODE (for some cluster) never turns auth off
        first = embedded_ray.acquire(ray_dir, 600.0, RAY_VERSION, {**os.environ, "RAY_AUTH_MODE": "disabled"}, LOG)
    assert first.address != "127.0.0.1:1" and not leftover.exists()
    assert "stale" in (ray_dir / "history.log").read_text()
    # its GCS and Ray Client server answer a call without the token with UNAUTHENTICATED
    check = [sys.executable, str(REPO / "scripts" / "embedded_ray_auth_check.py"), str(ray_dir)]
    probed = subprocess.run(
        check, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert probed.returncode == 0, probed.stdout + probed.stderr
    assert "Ray Client server without the token" in probed.stdout and first.auth_mode == "token"
    # a real Ray whose keeper died (nobody would ever stop it): its head is stopped, a new one started
    os.kill(first.keeper_pid, signal.SIGKILL)
    assert _gone(first.keeper_pid, 0, 10)
    with embedded_ray.locked(ray_dir):
        second = embedded_ray.acquire(ray_dir, 600.0, RAY_VERSION, dict(os.environ), LOG)
    assert second.address != first.address and second.head_pid != first.head_pid
    assert _gone(first.head_pid, first.head_started, 30), "the stale Ray's head outlived its replacement"
    assert not Path(first.temp_dir).exists()
    assert len(_starts(ray_dir)) == 2


def test_concurrent_runs_share_one_warm_ray_which_stops_once_idle(
    airflow_db, ray_dir, text_length_model, batchinfer_home, tmp_path, monkeypatch
):
    """Two ``airflow dags test`` processes at once, each with its own AIRFLOW_HOME (SQLite refuses
    concurrent writers) and one shared BATCHINFER_RAY_DIR: one Ray is started, both runs commit once,
    both leases are given back, and the Ray stops after its idle timeout with its state cleared."""
    monkeypatch.setenv("BATCHINFER_IN_DRIVER_MAX_ROWS", "0")  # small inputs, but actor pools on the one Ray
    monkeypatch.setenv(embedded_ray.IDLE_ENV, "20")
    data = write_tickets(tmp_path / "in", rows=200, files=2)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs = []
    for n in range(2):
        home = tmp_path / f"airflow{n}"
        home.mkdir()
        shutil.copy(airflow_db / "airflow.db", home / "airflow.db")
        run_env = dict(
            env,
            AIRFLOW_HOME=str(home),
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
        )
        conf = json.dumps({"input": str(data), "out": str(tmp_path / f"out{n}")})
        cmd = [sys.executable, "-m", "airflow", "dags", "test", "bi_test_error_mode", "-c", conf]
        cmd += ["-B", "test_dags"]  # the session's bundle of tests/dags (conftest)
        log = open(tmp_path / f"run{n}.log", "w")
        procs.append((subprocess.Popen(cmd, env=run_env, stdout=log, stderr=subprocess.STDOUT, cwd=home), log))
    started = time.monotonic()
    # A deadlock never ends (0 rows after 90 s, once); a loaded 2-core machine does, late. The bound
    # is for the deadlock, not for the machine's speed.
    budget_s = 480
    try:
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(1.0, budget_s - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                progress = [
                    [line[:160] for line in (tmp_path / f"run{n}.log").read_text().splitlines() if "progress:" in line][
                        -1:
                    ]
                    for n in range(2)
                ]
                pytest.fail(
                    f"two concurrent runs on one embedded Ray stalled for {budget_s} s; last progress: {progress}"
                )
        print(f"two concurrent runs took {time.monotonic() - started:.1f}s")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = [(tmp_path / f"run{n}.log").read_text() for n in range(2)]
    for n in range(2):
        run_dir = tmp_path / f"out{n}"
        assert (run_dir / SUCCESS_MARKER).exists(), logs[n][-4000:]
        manifest = committed_manifest(str(run_dir))
        assert manifest["counts"] == {"input_rows": 200, "output_rows": 200, "error_rows": 0}
        assert len(list(run_dir.glob("part-*.parquet"))) == len(manifest["files"])  # exactly once
    history = (ray_dir / "history.log").read_text()
    assert len(_starts(ray_dir)) == 1, history
    # "(embedded Ray at <host:port>)" or "... at <host:port> (state in <dir>)": the address only
    addresses = {address for text in logs for address in re.findall(r"embedded Ray at ([0-9.]+:[0-9]+)", text)}
    assert len(addresses) == 1, addresses
    state = embedded_ray.read_state(ray_dir)
    assert state is not None and state.idle_s == 20.0, history
    assert not list((ray_dir / "leases").iterdir())  # both jobs gave their lease back
    assert _gone(state.head_pid, state.head_started, 90), "the embedded Ray did not stop after its idle timeout"
    with embedded_ray.locked(ray_dir):  # the keeper holds the lock until it has forgotten the stopped Ray
        assert embedded_ray.read_state(ray_dir) is None and not Path(state.temp_dir).exists()
    assert "idle for 20s" in (ray_dir / "history.log").read_text()


def test_no_embedded_ray_module_imports_airflow_or_ray():
    code = (
        "import sys; import airflow_provider_batchinfer.launchers.embedded_ray, airflow_provider_batchinfer.launchers.local;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('airflow', 'ray')]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_proc_identity_guards_against_reused_pids():
    me = proc_start_time(os.getpid())
    assert me and proc_alive(os.getpid(), me) and not proc_alive(os.getpid(), me + 1)
