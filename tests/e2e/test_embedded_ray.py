"""The embedded default's one warm local Ray (launchers/embedded/embedded_ray.py): started by the first job,
reused by later and concurrent jobs, stopped after its idle timeout, replaced when stale. Jobs run
with no Ray address configured (RAY_ADDRESS removed), each test on its own state directory."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER
from airflow_provider_batchinfer.contract.specs import JobSpec
from airflow_provider_batchinfer.launchers.base import LaunchError
from airflow_provider_batchinfer.launchers.embedded import embedded_ray, ray_head, state_dirs
from airflow_provider_batchinfer.launchers.embedded.procs import group_cmdlines, proc_alive, proc_start_time
from airflow_provider_batchinfer.launchers.local import PARENT_PID_ENV, LocalLauncher
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
    """The launcher gets its embedded Ray in the private fallback, under that directory's lock, and
    leases it there; the foreign directory stays empty (``tests/component/test_local_trust.py``
    attacks the directory itself). No Ray is started: what ``acquire`` does in a directory it is
    handed is ``test_stale_states_are_replaced``'s and the concurrent runs' claim."""
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
    acquired: list[tuple[Path, bool]] = []

    def acquire(directory, idle_s, ray_version, environ, log, while_starting=None):
        acquired.append((directory, _lock_held(directory)))
        return embedded_ray.EmbeddedRay(
            address="127.0.0.1:9",  # nothing listens there: the job below fails before it would attach
            head_pid=0,
            head_started=0,
            keeper_pid=0,
            temp_dir=str(tmp_path / "ray"),
            ray_version=ray_version,
            uid=os.getuid(),
            auth_mode="token",
            token_path=None,
            idle_s=idle_s,
            started_at=time.time(),
        )

    monkeypatch.setattr(embedded_ray, "acquire", acquire)

    class Log:
        def info(self, msg, *args):
            LOG.info(msg, *args)

        def warning(self, msg, *args):
            warnings.append(msg % args)

        error = warning

    # a job that needs the actor pool: a one-replica job needs no Ray
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
        assert acquired == [(fallback, True)]
        assert len(list((fallback / "leases").iterdir())) == 1  # the job's lease, beside its Ray
        assert any(f"state directory {foreign} is not used: {foreign} belongs to uid 65534" in w for w in warnings)
        launcher.wait(handle, LOG.info)  # its job file does not exist: it fails, and gives its lease back
        assert not list((fallback / "leases").iterdir())
        assert os.listdir(foreign) == []
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(foreign, ignore_errors=True)


def _lock_held(directory: Path) -> bool:
    """Someone holds ``directory``'s lock (a lock of this process's own, taken on another open file, counts)."""
    import fcntl

    with open(directory / "lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


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
def test_a_head_whose_raylet_dies_stops_every_other_process_of_its_ray(ray_dir):
    """The head watches its node's processes as ``ray start --block`` did: one killed, it stops the
    rest and exits, and the next job finds a stale state and starts a new Ray."""
    with embedded_ray.locked(ray_dir):
        state = embedded_ray.acquire(ray_dir, 600.0, RAY_VERSION, dict(os.environ), LOG)
    try:
        raylets = [line for line in _group_pids(state.head_pid) if "raylet/raylet" in line[1]]
        assert raylets, group_cmdlines(state.head_pid)
        os.kill(raylets[0][0], signal.SIGKILL)
        assert _gone(state.head_pid, state.head_started, 30), "the head outlived its raylet"
        deadline = time.monotonic() + 30
        while _group_pids(state.head_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_pids(state.head_pid), group_cmdlines(state.head_pid)  # the GCS and agents too
        assert "('raylet', -9)" in (ray_dir / "head.log").read_text()  # which process ended, and how
    finally:
        embedded_ray.shutdown(ray_dir)


def _group_pids(group: int) -> list[tuple[int, str]]:
    """The live (not zombie) processes of a process group: pid and command line."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if entry.name.isdigit() and int(fields[2]) == group and fields[0] != "Z":
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_a_job_started_beside_a_ray_that_does_not_come_up_is_stopped_and_leaves_no_lease(ray_dir, monkeypatch):
    """The job starts while its Ray starts (its checks need none); a start that fails stops it."""
    monkeypatch.setenv(ray_head.START_HOOK_ENV, "no_such_module.hook")  # the head exits at once
    launcher = LocalLauncher()
    env = launcher.environment()
    job = [sys.executable, "-c", "import os, time; print(os.environ['BATCHINFER_EMBEDDED_RAY_READY']); time.sleep(120)"]
    with pytest.raises(LaunchError, match=r"the embedded Ray did not start \(exit 1\); its log "):
        launcher._start_embedded(job, env, LOG)
    assert launcher._proc is not None and launcher._proc.poll() is not None  # it was started, and stopped
    assert env["BATCHINFER_EMBEDDED_RAY_READY"].endswith("/batchinfer-ready")
    assert not list((ray_dir / "leases").iterdir()) and embedded_ray.read_state(ray_dir) is None


def test_stale_states_are_replaced(ray_dir, monkeypatch):
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
    assert first.address != "127.0.0.1:1" and not leftover.exists() and not leftover.parent.exists()
    assert "stale" in (ray_dir / "history.log").read_text()
    _only_we_reach_rays_temp_dir(Path(first.temp_dir))
    # its GCS answers a call without the token with UNAUTHENTICATED, and it runs no Ray Client server; probed from
    # a process of its own: a probe without the token leaves Ray's auth settings in the process that
    # made it, and a later test of this worker could then not reach a cluster that takes the token
    check = [sys.executable, str(REPO / "scripts" / "embedded_ray_auth_check.py"), str(ray_dir)]
    probed = subprocess.run(
        check, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert probed.returncode == 0, probed.stdout + probed.stderr
    assert first.auth_mode == "token" and "GCS without the token" in probed.stdout
    assert "no Ray Client server among the head's processes" in probed.stdout  # not started (ray_head.py)
    # a real Ray whose keeper died (nobody would ever stop it): its head is stopped and a new Ray is
    # started (the start itself is the one above: recorded here, not repeated)
    os.kill(first.keeper_pid, signal.SIGKILL)
    assert _gone(first.keeper_pid, 0, 10)
    started: list[Path] = []
    second = object()
    monkeypatch.setattr(embedded_ray, "_start", lambda directory, *args: started.append(directory) or second)
    with embedded_ray.locked(ray_dir):
        assert embedded_ray.acquire(ray_dir, 600.0, RAY_VERSION, dict(os.environ), LOG) is second
    assert started == [ray_dir]
    assert _gone(first.head_pid, first.head_started, 30), "the stale Ray's head outlived its replacement"
    assert not Path(first.temp_dir).parent.exists() and embedded_ray.read_state(ray_dir) is None
    history = (ray_dir / "history.log").read_text()
    assert history.count(" stop ") == 2 and "stale" in history.splitlines()[-1], history
    assert len(_starts(ray_dir)) == 1


def _only_we_reach_rays_temp_dir(temp_dir: Path) -> None:
    """Ray's temp dir, session, sockets and logs are Ray's to make (world-writable, as it makes
    them); the directory above them is the provider's: 0700 and this uid's, so no other user
    reaches the raylet's socket or a job's log through it."""
    parent = os.lstat(temp_dir.parent)
    assert stat.S_ISDIR(parent.st_mode) and (stat.S_IMODE(parent.st_mode), parent.st_uid) == (0o700, os.getuid())
    sockets = temp_dir / "session_latest" / "sockets"
    assert any(p.is_socket() for p in sockets.iterdir()), list(sockets.iterdir())  # Ray's own, below it
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (temp_dir, sockets)}
    LOG.info("Ray made its directories below the private parent %s with modes %s", temp_dir.parent, modes)
    if os.getuid() == 0:  # as another user: not even a directory Ray made 0777 can be listed
        probe = "import os, sys; os.listdir(sys.argv[1])"
        done = subprocess.run(
            ["/usr/bin/python3", "-c", probe, str(sockets)], user=65534, group=65534, capture_output=True, text=True
        )
        assert done.returncode != 0 and "PermissionError" in done.stderr, (modes, done.stderr)


# One task as a worker runs it, in its own process: the operator on the embedded default (no
# connection, no Ray address), its log on stdout.
TASK_SCRIPT = r"""
import json, sys
from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec
from tests.task_context import TaskInstanceStandIn
args = json.loads(sys.argv[1])
op = BatchInferenceOperator(
    task_id="infer", model="text_length", version="v1", input=args["input"],
    output_spec=OutputSpec(stage_location=args["out"]), job_spec=JobSpec(max_batch_rows=100),
)
op.execute({"ti": TaskInstanceStandIn(run_id=args["run_id"])})
"""

# past the keeper's poll (a quarter of it, at most 1 s); two runs started together overlap, so the
# later one never waits on it
IDLE_S = 5


def _operator(data: Path, out: Path):
    from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec

    return BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=str(data),
        output_spec=OutputSpec(stage_location=str(out)),
        job_spec=JobSpec(max_batch_rows=100),
    )


def _state_while_leased(directory: Path, running: list, timeout_s: float = 480) -> embedded_ray.EmbeddedRay:
    """The embedded Ray as recorded while a job holds a lease on it (read under the lock: it cannot
    be stopped meanwhile). ``running``: objects with ``is_alive()`` or ``poll()``; none left
    running and no lease seen fails. The bound is for a deadlock, not for the machine's speed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with embedded_ray.locked(directory):
            state = embedded_ray.read_state(directory)
            if state is not None and list((directory / "leases").iterdir()):
                return state
        if not any(r.is_alive() if hasattr(r, "is_alive") else r.poll() is None for r in running):
            break
        time.sleep(0.2)
    raise AssertionError(f"no job held a lease on an embedded Ray in {directory}")


@pytest.mark.usefixtures("airflow_db")
def test_concurrent_runs_share_one_warm_ray_which_stops_once_idle(ray_dir, text_length_model, tmp_path, monkeypatch):
    """Two tasks at once, in two processes (a subprocess and this one), both started before either
    has a Ray, on one BATCHINFER_RAY_DIR: one Ray is started, both runs commit once, both leases
    are given back, and the Ray stops after its idle timeout with its state cleared."""
    from tests.task_context import TaskInstanceStandIn

    monkeypatch.setenv("BATCHINFER_IN_DRIVER_MAX_ROWS", "0")  # small inputs, but actor pools on the one Ray
    monkeypatch.setenv(embedded_ray.IDLE_ENV, str(IDLE_S))
    data = write_tickets(tmp_path / "in", rows=200, files=2)
    args = {"input": str(data), "out": str(tmp_path / "out0"), "run_id": "manual__concurrent_0"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(tmp_path / "run0.log", "w") as log:
        other = subprocess.Popen(
            [sys.executable, "-c", TASK_SCRIPT, json.dumps(args)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    outcome: dict[str, object] = {}

    def run_here() -> None:
        try:
            outcome["xcom"] = _operator(data, tmp_path / "out1").execute(
                {"ti": TaskInstanceStandIn(run_id="manual__concurrent_1")}
            )
        except BaseException as exc:  # re-raised below, in the test's thread
            outcome["error"] = exc

    here = threading.Thread(target=run_here)
    here.start()
    try:
        state = _state_while_leased(ray_dir, [other, here])
        head = " | ".join(group_cmdlines(state.head_pid))  # the trimmed head (ray_head.py)
        here.join(timeout=480)
        assert other.wait(timeout=480) == 0, (tmp_path / "run0.log").read_text()[-4000:]
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert not here.is_alive() and "error" not in outcome, outcome
    nodes = []
    for n in range(2):
        run_dir = tmp_path / f"out{n}"
        assert (run_dir / SUCCESS_MARKER).exists(), (tmp_path / "run0.log").read_text()[-4000:]
        manifest = committed_manifest(str(run_dir))
        assert manifest["counts"] == {"input_rows": 200, "output_rows": 200, "error_rows": 0}
        assert manifest["job"]["pool"]["in_driver"] is False
        nodes += [node["node_id"] for node in manifest["job"]["pool"]["nodes"]]
        assert len(list(run_dir.glob("part-*.parquet"))) == len(manifest["files"])  # exactly once
    history = (ray_dir / "history.log").read_text()
    assert len(_starts(ray_dir)) == 1, history
    assert "log_monitor.py" in head and "gcs_server" in head, head  # what a job uses (workers' lines) runs
    assert "ray.util.client.server" not in head and "autoscaler/_private/monitor.py" not in head, head
    assert "dashboard/dashboard.py" not in head, head  # nor the API server
    assert len(nodes) == 2 and len(set(nodes)) == 1, nodes  # both pools on the one Ray's node (a new id per start)
    assert state.idle_s == IDLE_S, history
    assert not list((ray_dir / "leases").iterdir())  # both jobs gave their lease back
    assert _gone(state.head_pid, state.head_started, 90), "the embedded Ray did not stop after its idle timeout"
    with embedded_ray.locked(ray_dir):  # the keeper holds the lock until it has forgotten the stopped Ray
        assert embedded_ray.read_state(ray_dir) is None and not Path(state.temp_dir).exists()
    assert f"idle for {IDLE_S}s" in (ray_dir / "history.log").read_text()


def test_no_embedded_ray_module_imports_airflow_or_ray():
    code = (
        "import sys; import airflow_provider_batchinfer.launchers.embedded.embedded_ray, airflow_provider_batchinfer.launchers.local;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('airflow', 'ray')]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_proc_identity_guards_against_reused_pids():
    me = proc_start_time(os.getpid())
    assert me and proc_alive(os.getpid(), me) and not proc_alive(os.getpid(), me + 1)
