"""Local trust boundaries of the embedded default, each attacked: the embedded Ray never runs without
token auth; a state directory planted by another user (foreign owner, group/world bits, a symbolic
link) is never used and never fails a job for good; a stop removes only the temp dir the provider
made; a job's environment goes only to the spare its socket's name says. No Ray is started here."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, handover
from airflow_provider_batchinfer.contract.specs import InputSpec
from airflow_provider_batchinfer.launchers.base import SUCCEEDED, LaunchError
from airflow_provider_batchinfer.launchers.embedded import embedded_ray, state_dirs, warm_runtime
from airflow_provider_batchinfer.launchers.local import LocalLauncher
from airflow_provider_batchinfer.store import private_dir
from tests.models import WhereLength, job_file, write_job_file, write_tickets

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")


class Log:
    """A task log that keeps its lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg, *args):
        self.lines.append(msg % args if args else msg)

    warning = error = info


def _private_tmp(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@pytest.fixture
def scratch():
    """A short directory under /tmp of this test's own (sockets and planted directories live in it)."""
    directory = _private_tmp("bir-lt-")
    os.chmod(directory, 0o755)  # a parent like a home directory: others may look, not write
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)


def _plant(scratch: Path, how: str) -> tuple[Path, Path]:
    """A directory another user could have left where the state directory is configured: the path
    to configure and the directory it leads to (to see that nothing was written there)."""
    target = scratch / f"{how}-target"
    target.mkdir()
    if how == "foreign":
        os.chown(target, NOBODY, NOBODY)
        os.chmod(target, 0o700)
        return target, target
    if how == "world-writable":
        os.chmod(target, 0o777)
        return target, target
    os.chmod(target, 0o700)
    if how == "link-to-foreign":
        os.chown(target, NOBODY, NOBODY)
    link = scratch / f"{how}-link"
    link.symlink_to(target)  # "link-to-ours": a private directory of ours, reached through someone's link
    return link, target


# --- the version gate --------------------------------------------------------------------------------
def test_the_embedded_ray_needs_a_ray_with_token_auth(scratch):
    for good in ("2.52.0", "2.60.0", "3.0.0.dev0"):
        embedded_ray.require_token_auth(good)
    for bad in ("2.50.0", "2.51.1", "1.13.0", None, "unknown"):
        with pytest.raises(LaunchError, match=r"needs Ray 2\.52 or later, the first release with token auth") as info:
            embedded_ray.require_token_auth(bad)
        assert info.value.permanent
    # what a launcher does with a Ray 2.51: refused before anything starts, nothing recorded
    directory = scratch / "state"
    refused = pytest.raises(LaunchError, match=r"this worker has Ray 2\.51\.0\. Without it .* Ray Client server")
    with embedded_ray.locked(directory), refused:
        embedded_ray.acquire(directory, 600.0, "2.51.0", dict(os.environ), Log())
    assert not (directory / "state.json").exists() and not (directory / "history.log").exists()


def test_the_ray_floor_is_the_first_release_with_token_auth():
    import tomllib

    root = Path(__file__).resolve().parents[2]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    [ray] = [d for d in deps if d.startswith("ray[")]
    assert ">=2.52," in ray, ray
    assert "ray==2.52.0" in (root / "constraints" / "lowest-3.11.txt").read_text().splitlines()


# --- the state directory ---------------------------------------------------------------------------------
@as_root
@pytest.mark.parametrize("how", ["foreign", "world-writable", "link-to-ours", "link-to-foreign"])
def test_a_planted_state_dir_is_never_used_and_never_fails_a_job_for_good(scratch, how):
    configured, target = _plant(scratch, how)
    refused = pytest.raises(LaunchError, match=r"state directory is not used: .* set BATCHINFER_RAY_DIR")
    with refused as info, embedded_ray.locked(configured):
        pass
    assert not info.value.permanent  # another user's directory never fails a job for good
    log = Log()
    runtime = _private_tmp("bir-xdg-")
    try:
        used = embedded_ray.private_state_dir(
            {embedded_ray.DIR_ENV: str(configured), "XDG_RUNTIME_DIR": str(runtime)}, log
        )
        assert used == runtime / "batchinfer-ray"
        private_dir.check(used)
        with embedded_ray.locked(used):  # usable: the lock and leases go there
            embedded_ray.add_lease(used, os.getpid())
        [warning] = log.lines
        assert f"state directory {configured} is not used" in warning and f"private directory {used}" in warning
        assert {"foreign": "belongs to uid 65534", "world-writable": "is writable by other users (mode 0o777)"}.get(
            how, "symbolic link"
        ) in warning
    finally:
        shutil.rmtree(runtime)
    assert os.listdir(target) == []  # nothing was written where the other user could read or swap it


@as_root
def test_without_a_runtime_dir_the_fallback_is_one_fresh_private_directory_with_no_spares(scratch, monkeypatch):
    configured, _ = _plant(scratch, "foreign")
    monkeypatch.setenv(embedded_ray.DIR_ENV, str(configured))
    first = embedded_ray.private_state_dir()
    try:
        private_dir.check(first)
        assert first != configured and state_dirs.is_one_off(first)
        assert embedded_ray.private_state_dir() == first  # the same for this process's launcher, lease, spares
        assert warm_runtime.prestart(LocalLauncher().spare_environment(), "python", None, 120) is None
        assert not (first / "spares").exists()
    finally:
        shutil.rmtree(first)


def test_a_state_dir_of_our_own_is_created_private(scratch):
    wanted = scratch / "deeper" / "state"
    assert embedded_ray.private_state_dir({embedded_ray.DIR_ENV: str(wanted)}) == wanted
    assert (os.lstat(wanted).st_mode & 0o777) == 0o700
    with embedded_ray.locked(wanted):
        assert (os.lstat(wanted / "lock").st_mode & 0o777) == 0o600


@as_root
def test_a_job_with_a_planted_state_dir_runs_and_leaves_nothing_there(scratch, registry, tmp_path, monkeypatch):
    """A one-replica job (scored in its own process, through the spares' directory): it succeeds, and
    the spare started after it waits in the private fallback, not in the world-writable directory."""
    configured, target = _plant(scratch, "world-writable")
    runtime = _private_tmp("bir-xdg-")
    monkeypatch.setenv(embedded_ray.DIR_ENV, str(configured))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv(embedded_ray.IDLE_ENV, "30")
    signature = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
    model = registry.log_model("where_length", "v1", "python", python_class=WhereLength, signature=signature)
    data = write_tickets(tmp_path / "in", rows=50, files=1)
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    job = job_file(run_dir, model, registry.root, [data], input_spec=InputSpec(id_column="ticket_id"))
    launcher, log = LocalLauncher(), Log()
    try:
        outcome = launcher.wait(launcher.start(job, write_job_file(job), log), lambda line: None)
        assert outcome.status == SUCCEEDED, outcome.message
        assert (run_dir / SUCCESS_MARKER).exists()
        assert os.listdir(target) == []
        assert any(f"state directory {configured} is not used" in line for line in log.lines), log.lines
        spares = warm_runtime.spares_dir()
        assert spares.is_relative_to(runtime / "batchinfer-ray")
        assert warm_runtime.wait_ready(spares, timeout=60)
        assert warm_runtime.waiting(runtime / "batchinfer-ray")  # the next job's spare, in the fallback
    finally:
        shutil.rmtree(runtime)  # its spare exits once its directory is gone


# --- what a stop removes -------------------------------------------------------------------------------
def _stale_state(directory: Path, temp_dir: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with embedded_ray.locked(directory):
        state = {
            "address": "127.0.0.1:1",
            "head_pid": dead.pid,
            "head_started": 1,
            "keeper_pid": dead.pid,
            "temp_dir": str(temp_dir),
            "ray_version": "2.60.0",
            "uid": os.getuid(),
            "auth_mode": "token",
            "token_path": None,
            "idle_s": 600.0,
            "started_at": 0.0,
        }
        (directory / "state.json").write_text(json.dumps(state))


def _made_temp_dir(directory: Path) -> Path:
    """A temp dir the provider made for ``directory``'s Ray, checked to be ``r`` in a ``bir-*``
    parent of its own under /tmp before a test changes or removes that parent: never /tmp itself,
    whatever layout the code under test makes (a temp dir directly under /tmp is removed, and the
    test fails)."""
    temp_dir = Path(state_dirs.make_ray_temp_dir(directory))
    parent = temp_dir.parent
    if temp_dir.name != "r" or parent.parent != Path("/tmp") or not parent.name.startswith("bir-"):
        if temp_dir.parent == Path("/tmp") and temp_dir.name.startswith("bir-"):
            shutil.rmtree(temp_dir, ignore_errors=True)  # the fresh mkdtemp itself
        pytest.fail(f"the Ray temp dir {temp_dir} does not lie in a parent of its own")
    return temp_dir


def test_a_stop_removes_only_the_temp_dir_the_provider_made_for_that_state(scratch):
    directory = scratch / "state"
    precious = scratch / "precious"  # ours, private: what a state.json could name
    (precious / state_dirs.RAY_TEMP_NAME).mkdir(mode=0o700, parents=True)
    (precious / "keep.txt").write_text("data")
    elsewhere = _made_temp_dir(scratch / "another-state")  # the provider's, for another Ray
    made = _made_temp_dir(directory)
    link = scratch / "bir-link"  # a parent reached through a symbolic link: never followed
    link.symlink_to(made.parent)
    opened = _made_temp_dir(directory)  # made for this Ray, then opened to others
    os.chmod(opened.parent, 0o755)
    try:
        for named in (precious / "r", elsewhere, link / "r", opened, made.parent, Path("relative/r")):
            _stale_state(directory, named)
            assert embedded_ray.shutdown(directory)
            assert not (directory / "state.json").exists()  # the state is forgotten either way
        assert (precious / "keep.txt").read_text() == "data"
        assert elsewhere.parent.is_dir() and made.parent.is_dir() and opened.parent.is_dir()
        _stale_state(directory, made)
        assert embedded_ray.shutdown(directory)
        assert not made.parent.exists()  # its own temp dir's parent, private and marked: removed
    finally:
        for temp_dir in (elsewhere, made, opened):
            shutil.rmtree(temp_dir.parent, ignore_errors=True)


def test_ray_s_temp_dir_lies_below_a_private_parent_and_one_that_is_not_is_refused(scratch):
    """Ray makes its temp dir world-writable: only its parent, the provider's, keeps others out. A
    recorded Ray whose parent is not private (or a temp dir of the layout before it) gets no job."""
    temp_dir = _made_temp_dir(scratch / "state")
    try:
        parent = os.lstat(temp_dir.parent)
        assert temp_dir.name == "r" and not temp_dir.exists()  # Ray makes it, as it likes
        assert (stat.S_IMODE(parent.st_mode), parent.st_uid) == (0o700, os.getuid())
        assert len(str(temp_dir / "session_2026-11-05_10-22-33_123456_12345/sockets/plasma_store")) < 100
        assert state_dirs.ray_temp_refused(str(temp_dir)) is None
        os.chmod(temp_dir.parent, 0o711)  # others may not list it, but may pass through: refused
        assert "is readable by other users (mode 0o711); it must be 0700" in state_dirs.ray_temp_refused(str(temp_dir))
        os.chmod(temp_dir.parent, 0o700)
        link = scratch / "bir-link"
        link.symlink_to(temp_dir.parent)
        assert "is a symbolic link" in state_dirs.ray_temp_refused(str(link / "r"))
        legacy = "/tmp/bir-x1y2z3"  # a Ray started by an earlier version, directly in its own temp dir
        assert "is not inside a private directory of the provider's" in state_dirs.ray_temp_refused(legacy)
        for shared in ("/tmp/r", "/r"):  # never a parent that is not one of the provider's own
            assert state_dirs.ray_temp_refused(shared) and not state_dirs.remove_ray_temp_dir(shared, scratch / "state")
        state = _ray_state(str(link / "r"))
        assert embedded_ray._unusable(state, state.ray_version).startswith("cannot be used: its temp dir's parent")
        assert embedded_ray._unusable(_ray_state(str(temp_dir)), state.ray_version) is None
    finally:
        shutil.rmtree(temp_dir.parent, ignore_errors=True)


def _ray_state(temp_dir: str) -> embedded_ray.EmbeddedRay:
    return embedded_ray.EmbeddedRay(
        address="127.0.0.1:1",
        head_pid=0,
        head_started=0,
        keeper_pid=0,
        temp_dir=temp_dir,
        ray_version="2.60.0",
        uid=os.getuid(),
        auth_mode="token",
        token_path=None,
        idle_s=600.0,
        started_at=0.0,
    )


@as_root
def test_a_temp_dir_parent_of_another_user_is_refused(scratch):
    temp_dir = _made_temp_dir(scratch / "state")
    try:
        os.chown(temp_dir.parent, NOBODY, NOBODY)
        assert f"belongs to uid {NOBODY}" in state_dirs.ray_temp_refused(str(temp_dir))
        assert not state_dirs.remove_ray_temp_dir(str(temp_dir), scratch / "state")
        assert temp_dir.parent.is_dir()
    finally:
        shutil.rmtree(temp_dir.parent, ignore_errors=True)


# --- the spare's peer -----------------------------------------------------------------------------------
_LISTENER = r"""
import os, socket, sys
binding, uid = sys.argv[1], int(sys.argv[2])
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(binding)
if uid != os.getuid():
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # SO_PEERCRED records the listener's credentials when it listens
listener.listen(1)
print("listening", flush=True)
listener.settimeout(60)
conn, _ = listener.accept()
conn.settimeout(10)
received = b""
try:
    while chunk := conn.recv(65536):
        received += chunk
        if len(received) > 4 and b"SECRET" in received:
            break
except TimeoutError:
    pass
print(len(received), flush=True)
"""


def _impostor(directory: Path, name_pid: int | None, uid: int) -> tuple[subprocess.Popen[str], Path]:
    """A process listening in the spares' directory under a spare's name: named after ``name_pid``
    (None: its own pid), running as ``uid``."""
    binding = directory / ".impostor.binding"
    proc = subprocess.Popen(
        [sys.executable, "-c", _LISTENER, str(binding), str(uid)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    path = directory / handover.socket_name("python-native", proc.pid if name_pid is None else name_pid)
    os.rename(binding, path)  # ready, as a spare's socket is
    return proc, path


@pytest.mark.parametrize(
    "who",
    [pytest.param("another uid", marks=as_root), "another pid of ours"],
)
def test_the_launcher_sends_nothing_to_a_listener_that_is_not_the_spare(scratch, who, monkeypatch, caplog):
    monkeypatch.setenv(embedded_ray.DIR_ENV, str(scratch / "state"))
    environ = LocalLauncher().spare_environment()
    directory = warm_runtime.spares_dir(environ)
    with warm_runtime._locked(directory):
        pass
    if who == "another uid":  # the socket is named after the impostor's own pid: only its uid differs
        proc, path = _impostor(directory, None, NOBODY)
    else:  # ours, but not the process the name says (a reused pid, another of our processes)
        proc, path = _impostor(directory, os.getpid(), os.getuid())
    try:
        with caplog.at_level(logging.WARNING, logger=warm_runtime.__name__):
            warm = warm_runtime.hand_over(["--spec", "x"], {"AWS_SECRET_ACCESS_KEY": "SECRET"}, "python", None, environ)
        assert warm is None  # the job starts in a fresh process instead
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.split() == ["0"], f"the impostor received {out.split()} bytes"
    [refusal] = [r.getMessage() for r in caplog.records if r.name == warm_runtime.__name__]
    assert f"the process listening on {path.with_name(path.name + '.claimed')} is pid {proc.pid}" in refusal
    assert "nothing was sent to it" in refusal


def test_a_spare_does_not_listen_in_a_directory_others_can_write(scratch):
    directory = scratch / "open"
    directory.mkdir()
    os.chmod(directory, 0o777)
    cmd = [sys.executable, "-m", "airflow_provider_batchinfer.runtime.spare", "--dir", str(directory)]
    cmd += ["--kind", "python-native", "--flavor", "python", "--idle-s", "5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"not listening: {directory} is writable by other users (mode 0o777)" in done.stdout
    assert not list(directory.iterdir())
