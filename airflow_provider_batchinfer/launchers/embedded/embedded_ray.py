"""The embedded default's Ray: one warm, provider-owned local Ray shared by this machine's jobs.

Starting Ray takes about half of a small job's wall time, and every job starting its own Ray makes
concurrent jobs each believe they own every CPU. So the ``local`` launcher, when no Ray address is
configured, asks this module for *the* embedded Ray: the first job starts it (``ray_head.py``: Ray's
own head node, as ``ray start --head --block`` starts it, in its own session, loopback only, every
port picked free, its own short temp dir below a private parent), later and concurrent jobs attach to it, and a small
keeper process stops it after an idle timeout.

It always runs with Ray's token authentication (Ray 2.52 or later; an older Ray is refused): its
ports listen on loopback, where any local user could otherwise connect and run code as this worker's
user, reading the jobs' credentials from ``/proc``. It starts without the Ray Client server, the
autoscaler's monitor and the API server, which no job on it uses (``ray_head.py``).

Everything lives in a private state directory (``launchers/embedded/state_dirs.py``: ``BATCHINFER_RAY_DIR``,
default ``/tmp/batchinfer-ray-<uid>``, created 0700; one that is not private is never used)::

    lock          fcntl lock: starting, leasing and reaping are serialized on it
    state.json    the running Ray: GCS address, head/keeper pids, temp dir, Ray version, owner uid
    auth_token    the token this Ray and its drivers share (0600)
    leases/<pid>  one per running job, named after the runtime process (its start time inside)
    last_used     touched on every lease and release: the idle clock starts from its mtime
    history.log   one line per start and stop (who, when, why)
    head.log, keeper.log

Ray's temp dir is ``/tmp/bir-XXXXXXXX/r``: Ray makes it and its session's directories world-writable,
so its parent is the provider's, 0700, and a Ray whose parent is not private is never handed a job
(``state_dirs.make_ray_temp_dir``).

The keeper (``python -m airflow_provider_batchinfer.launchers.embedded.embedded_ray keep <dir>``) polls under
the lock, so a job never gets an address that is being stopped; it stops Ray by its process group,
never with ``ray stop`` (which stops every Ray on the machine). A state whose keeper or head is gone,
or whose GCS port is closed, is stale: its leftovers are stopped and a new Ray is started.

Imports neither Airflow nor Ray: Ray runs only in processes of its own (the head is ``ray_head.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from airflow_provider_batchinfer.contract.lines import EMBEDDED_RAY_ENV
from airflow_provider_batchinfer.launchers.base import LaunchError, TaskLog
from airflow_provider_batchinfer.launchers.embedded.procs import (
    free_ports,
    group_cmdlines,
    port_open,
    proc_alive,
    proc_start_time,
)
from airflow_provider_batchinfer.launchers.embedded.ray_head import PORTS, READY_LINE
from airflow_provider_batchinfer.launchers.embedded.state_dirs import (
    DIR_ENV,
    add_lease,
    drop_lease,
    is_one_off,
    live_leases,
    locked,
    make_ray_temp_dir,
    mark_used,
    private_state_dir,
    ray_temp_refused,
    remove_ray_temp_dir,
    state_dir,
)

__all__ = [
    "DEFAULT_IDLE_S",
    "DIR_ENV",
    "IDLE_ENV",
    "EmbeddedRay",
    "acquire",
    "add_lease",
    "drop_lease",
    "idle_seconds",
    "installed_ray_version",
    "live_leases",
    "locked",
    "private_state_dir",
    "read_state",
    "require_token_auth",
    "shutdown",
    "state_dir",
]

IDLE_ENV = "BATCHINFER_RAY_IDLE_S"
DEFAULT_IDLE_S = 600.0
START_TIMEOUT_S = 120.0
#: the head's program, run with this Python
HEAD_MODULE = "airflow_provider_batchinfer.launchers.embedded.ray_head"
READY_FILE = "batchinfer-ready"
#: the first Ray release with token authentication (RAY_AUTH_MODE=token)
TOKEN_AUTH_SINCE = (2, 52)
#: never handed to the shared Ray: another cluster's address and token, a job's parent pid
_NOT_INHERITED = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "BATCHINFER_PARENT_PID")
#: the raylet kills a task worker idle for 1 s while the node runs more workers (actors included) than
#: this, by default its CPUs: a pool job's actors exceed two, so each read and write task started a fresh
#: Python process. A job's workers still exit with its driver; an operator's own setting wins
WORKER_SOFT_LIMIT_ENV, WORKER_SOFT_LIMIT = "RAY_num_workers_soft_limit", 64
#: a Ray process that finds a local socket not yet there (the raylet its object store's, a worker its
#: raylet's) waits this long before it looks again, 1 s by default: a raylet whose store came up a
#: moment late registered a whole second later. Ten times as many looks, ten times as often, keep
#: Ray's own 10 s budget. An operator's own settings win
CONNECT_RETRY_ENV = {
    "RAY_raylet_client_connect_timeout_milliseconds": "100",
    "RAY_raylet_client_num_connect_attempts": "100",
}


def installed_ray_version() -> str | None:
    """This interpreter's Ray version, read without importing Ray."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return None


def require_token_auth(ray_version: str | None) -> None:
    """Refuse to run the embedded Ray on a Ray without token authentication: it would listen on
    this machine's loopback ports for any local user."""
    found = re.match(r"(\d+)\.(\d+)", ray_version or "")
    if found and (int(found[1]), int(found[2])) >= TOKEN_AUTH_SINCE:
        return
    since = ".".join(map(str, TOKEN_AUTH_SINCE))
    has = f"Ray {ray_version}" if found else "no usable Ray"
    raise LaunchError(
        f"the embedded Ray needs Ray {since} or later, the first release with token authentication; this "
        f"worker has {has}. Without it the embedded Ray's ports, "
        f"its Ray Client server among them, would accept any local user's code, run as this worker's user. "
        f"Install ray[data,default]>={since}, or give the job a Ray cluster's address",
        permanent=True,
    )


def idle_seconds(value: float | None = None, environ: Mapping[str, str] = os.environ) -> float:
    """The idle timeout: ``value`` when given, else ``BATCHINFER_RAY_IDLE_S``, else 600 s."""
    if value is None:
        raw = environ.get(IDLE_ENV)
        try:
            value = float(raw) if raw else DEFAULT_IDLE_S
        except ValueError:
            raise LaunchError(f"{IDLE_ENV}={raw!r} is not a number of seconds", permanent=True) from None
    if value < 0:
        raise LaunchError(f"the embedded Ray's idle timeout must be >= 0 seconds, got {value}", permanent=True)
    return float(value)


@dataclass(frozen=True)
class EmbeddedRay:
    """A running embedded Ray, as ``state.json`` records it."""

    address: str  # GCS host:port
    head_pid: int  # the head (ray_head.py), leader of the process group that holds every Ray process
    head_started: int  # its start time (clock ticks since boot): guards against a reused pid
    keeper_pid: int
    temp_dir: str
    ray_version: str
    uid: int
    auth_mode: str  # "token" or "disabled"
    token_path: str | None
    idle_s: float
    started_at: float

    def driver_env(self) -> dict[str, str]:
        """What a driver needs to attach: the address and the same auth settings as the head."""
        # loopback: without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 a driver looks for its raylet on the
        # machine's outward IP and waits forever for a node registered as 127.0.0.1
        env = {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": self.auth_mode, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env[EMBEDDED_RAY_ENV] = "1"  # the driver shares the only node's machine (runtime/engine/in_driver.py)
        if self.token_path:
            env["RAY_AUTH_TOKEN_PATH"] = self.token_path
        return env


# --- the state -------------------------------------------------------------------------------------
def read_state(directory: Path) -> EmbeddedRay | None:
    """The recorded Ray, or None (no state, or one this version cannot read)."""
    try:
        return EmbeddedRay(**json.loads((directory / "state.json").read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _write_state(directory: Path, state: EmbeddedRay) -> None:
    tmp = directory / "state.json.tmp"
    tmp.write_text(json.dumps(asdict(state)))
    tmp.replace(directory / "state.json")


def _note(directory: Path, event: str, state: EmbeddedRay, why: str) -> None:
    with open(directory / "history.log", "a") as history:
        history.write(
            f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {event} {state.address} head={state.head_pid} "
            f"by pid {os.getpid()}: {why}\n"
        )


# --- start, check, stop ------------------------------------------------------------------------
def _healthy(state: EmbeddedRay, probe_port: bool = True) -> bool:
    """Its head and keeper run and (``probe_port``) its GCS accepts connections: three tries, so a
    busy machine's slow accept never gets a Ray with running jobs replaced."""
    host, _, port = state.address.rpartition(":")
    alive = (
        state.uid == os.getuid()
        and proc_alive(state.head_pid, state.head_started)
        and state.keeper_pid > 0
        and proc_alive(state.keeper_pid)
    )
    return alive and (not probe_port or any(port_open(host, int(port), timeout=2.0) for _ in range(3)))


def _stop(directory: Path, state: EmbeddedRay, why: str, grace_s: float = 5.0) -> None:
    """Stop the recorded Ray by its process group (SIGTERM, then SIGKILL) and forget it. The group is
    signalled only while it is provably ours (the head itself, or a member whose command line names
    our temp dir), never a later process group that reuses the pid. The grace is short: SIGTERM
    reaches every process of the group at once (raylet, GCS, workers), and the head then
    only waits out its drain timeout (30 s) for processes that are already gone."""
    _note(directory, "stop", state, why)
    if _ours(state):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(state.head_pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while proc_alive(state.head_pid, state.head_started) and time.monotonic() < deadline:
            time.sleep(0.2)
    if _ours(state):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(state.head_pid, signal.SIGKILL)  # whatever of Ray's processes is left in its group
    remove_ray_temp_dir(state.temp_dir, directory)  # never a directory the provider did not make for this Ray
    (directory / "state.json").unlink(missing_ok=True)


def _ours(state: EmbeddedRay) -> bool:
    if proc_alive(state.head_pid, state.head_started):
        return True
    return any(state.temp_dir in cmdline for cmdline in group_cmdlines(state.head_pid))


def _auth(directory: Path) -> tuple[str, str]:
    """Token auth, whatever the environment says; the token is this Ray's own file, so another
    `ray start` on the machine regenerating ``~/.ray/auth_token`` cannot lock our drivers out."""
    token = directory / "auth_token"
    try:
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return "token", str(token)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))
    return "token", str(token)


def head_env(environ: Mapping[str, str], auth_mode: str, token_path: str) -> dict[str, str]:
    """The environment of the head (``ray_head.py``): this process's, less another cluster's address
    and token, with token auth, no usage stats, idle task workers kept (``WORKER_SOFT_LIMIT``) and
    local sockets looked for again sooner (``CONNECT_RETRY_ENV``)."""
    env = {k: v for k, v in environ.items() if k not in _NOT_INHERITED}
    env.update(RAY_AUTH_MODE=auth_mode, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env["RAY_AUTH_TOKEN_PATH"] = token_path
    env.setdefault(WORKER_SOFT_LIMIT_ENV, str(WORKER_SOFT_LIMIT))
    for name, value in CONNECT_RETRY_ENV.items():
        env.setdefault(name, value)
    return env


def ready_file(state: EmbeddedRay) -> Path:
    """The file that says this Ray is up: created once it is, inside its temp dir (gone with it)."""
    return Path(state.temp_dir) / READY_FILE


def _start(
    directory: Path,
    idle_s: float,
    ray_version: str,
    environ: Mapping[str, str],
    log: TaskLog,
    while_starting: Callable[[EmbeddedRay], None] | None = None,
) -> EmbeddedRay:
    port, *picked = free_ports(1 + len(PORTS))  # distinct: Ray refuses to start when two components share one
    temp_dir = make_ray_temp_dir(directory)
    auth_mode, token_path = _auth(directory)
    env = head_env(environ, auth_mode, token_path)
    cmd = [sys.executable, "-m", HEAD_MODULE, f"--port={port}", f"--temp-dir={temp_dir}"]
    cmd += [f"--{name}-port={p}" for name, p in zip(PORTS, picked, strict=True)]  # never collide with another Ray here
    log.info("Starting the embedded Ray (state in %s, idle timeout %gs): %s", directory, idle_s, " ".join(cmd))
    with open(directory / "head.log", "w") as out:
        head = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    state = EmbeddedRay(
        address=f"127.0.0.1:{port}",
        head_pid=head.pid,
        head_started=proc_start_time(head.pid) or 0,
        keeper_pid=0,  # recorded before the wait: a starter killed mid-start leaves a state to clean up
        temp_dir=temp_dir,
        ray_version=ray_version,
        uid=os.getuid(),
        auth_mode=auth_mode,
        token_path=token_path,
        idle_s=idle_s,
        started_at=time.time(),
    )
    _write_state(directory, state)
    if while_starting is not None:  # work that needs no Ray yet runs beside Ray's start (the job's checks)
        while_starting(state)
    _wait_ready(directory, state, head)
    ready_file(state).touch(mode=0o600)
    mark_used(directory)  # the idle clock starts when Ray is up
    _note(directory, "start", state, f"Ray {ray_version}, up in {time.time() - state.started_at:.1f}s")
    with open(directory / "keeper.log", "a") as out:
        keeper = subprocess.Popen(
            [sys.executable, "-m", __name__, "keep", str(directory)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in environ.items() if k not in _NOT_INHERITED},
            start_new_session=True,
        )
    state = EmbeddedRay(**{**asdict(state), "keeper_pid": keeper.pid})
    _write_state(directory, state)
    return state


def _wait_ready(directory: Path, state: EmbeddedRay, head: subprocess.Popen[bytes]) -> None:
    port = int(state.address.rpartition(":")[2])
    deadline = time.monotonic() + START_TIMEOUT_S
    log_path = directory / "head.log"
    while not (port_open("127.0.0.1", port) and READY_LINE in log_path.read_text(errors="replace")):
        if head.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:]
            _stop(directory, state, "it did not start")
            raise LaunchError(f"the embedded Ray did not start (exit {head.poll()}); its log {log_path}:\n{tail}")
        time.sleep(0.05)  # the job, started beside, waits on this file


def acquire(
    directory: Path,
    idle_s: float,
    ray_version: str,
    environ: Mapping[str, str],
    log: TaskLog,
    while_starting: Callable[[EmbeddedRay], None] | None = None,
) -> EmbeddedRay:
    """The running embedded Ray, started or replaced as needed; call with :func:`locked` held and
    add the job's lease before releasing it. ``while_starting`` is called with the state of a Ray
    this call starts, before it waits for that Ray to come up (:func:`ready_file` says when)."""
    require_token_auth(ray_version)
    state = read_state(directory)
    if state is not None and not _healthy(state):
        log.warning("The embedded Ray recorded in %s is gone or unreachable; starting a new one", directory)
        _stop(directory, state, "stale: its head, keeper or GCS port is gone")
        state = None
    differs = None if state is None else _unusable(state, ray_version)
    if state is not None and differs:
        busy = live_leases(directory)
        if busy:
            raise LaunchError(
                f"the embedded Ray in {directory} {differs}, and {len(busy)} job(s) still use it; a retry after "
                "they end starts a new one"
            )
        log.warning("The embedded Ray %s: replacing it", differs)
        _stop(directory, state, f"it {differs}")
        state = None
    if state is None:
        return _start(directory, idle_s, ray_version, environ, log, while_starting)
    if state.idle_s != idle_s:  # the latest job's setting wins; the keeper reads it every poll
        state = EmbeddedRay(**{**asdict(state), "idle_s": idle_s})
        _write_state(directory, state)
    log.info("Using the warm embedded Ray at %s (state in %s)", state.address, directory)
    return state


def _unusable(state: EmbeddedRay, ray_version: str) -> str | None:
    """Why a healthy recorded Ray is not handed to a job, or None: another Ray version, no token
    auth, or a temp dir whose parent is not private (Ray makes its own dirs world-writable)."""
    if state.ray_version != ray_version or state.auth_mode != "token":
        return f"runs Ray {state.ray_version} with auth {state.auth_mode}, not Ray {ray_version} with token auth"
    refused = ray_temp_refused(state.temp_dir)
    return f"cannot be used: {refused}" if refused else None


def shutdown(directory: Path) -> bool:
    """Stop the embedded Ray recorded in ``directory`` now (its keeper exits on its next poll)."""
    if not (directory / "state.json").exists():
        return False
    with locked(directory):
        state = read_state(directory)
        if state is None:
            return False
        _stop(directory, state, "shutdown() asked for it")
        return True


# --- the keeper ------------------------------------------------------------------------------------
def idle_for(directory: Path, state: EmbeddedRay) -> float:
    """Seconds since the embedded Ray was last used; 0 while a job holds a lease (call with the lock
    held). Leases are checked first: dropping an ended job's lease restarts the clock, and a clock
    read before that would still stand at the lease's start, so a job longer than the idle timeout
    had its Ray stopped the moment its process exited (in CI: Ray gone 6 s after a 34 s
    job with a 20 s timeout, before the test could see it)."""
    if live_leases(directory):
        return 0.0
    last = max([state.started_at] + [p.stat().st_mtime for p in directory.glob("last_used")])
    return max(0.0, time.time() - last)


def keep(directory: Path) -> int:
    """Poll the leases; stop Ray after ``idle_s`` seconds with none, or when Ray itself died."""
    me = os.getpid()
    while True:
        with locked(directory):
            state = read_state(directory)
            if state is None or state.keeper_pid != me:
                print(f"{time.ctime()} keeper {me}: no longer the keeper of {directory}; exiting", flush=True)
                return 0
            if not _healthy(state, probe_port=False):
                print(f"{time.ctime()} keeper {me}: Ray at {state.address} died; cleaning up", flush=True)
                _stop(directory, state, "Ray itself died")
                return 0
            if idle_for(directory, state) >= state.idle_s:
                print(f"{time.ctime()} keeper {me}: idle {state.idle_s:g}s; stopping Ray {state.address}", flush=True)
                _stop(directory, state, f"idle for {state.idle_s:g}s")
                if is_one_off(directory):  # one task's fallback: no later job comes back to it
                    shutil.rmtree(directory, ignore_errors=True)
                return 0
            poll = min(1.0, max(0.2, state.idle_s / 4))
        time.sleep(poll)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "keep":
        return keep(Path(argv[1]))
    if len(argv) == 2 and argv[0] == "stop":
        return 0 if shutdown(Path(argv[1])) else 1
    print(
        "usage: python -m airflow_provider_batchinfer.launchers.embedded.embedded_ray keep|stop <state dir>",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
