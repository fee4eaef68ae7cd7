"""Where the embedded default keeps its state, and which directories it may remove.

The state directory (``BATCHINFER_RAY_DIR``, default ``/tmp/batchinfer-ray-<uid>``) holds the lock,
the running Ray's ``state.json`` and token, the leases and the spares' sockets: whoever can write
to it can point ``_stop`` at a directory to remove or plant a socket that receives a job's
environment. So it is used only when private (``store/private_dir.py``). A predictable name in
``/tmp`` can be taken by any local user first; when the configured one is not private the job uses
a private fallback instead of failing (a squatter must not be able to stop every job):
``$XDG_RUNTIME_DIR/batchinfer-ray`` when that is private, else a fresh directory of ``mkdtemp``
marked one-off (no spares wait in it: no later job would find them; its keeper removes it).

Ray's own temp dir is ``r`` inside a separate ``mkdtemp`` under ``/tmp`` (its sockets' paths must
stay short). Ray makes its temp dir and the session, ``sockets/``, ``logs/`` and
``runtime_resources/`` directories below it world-writable (``chmod 0777``, no sticky bit), where
any local user could read the jobs' logs, replace the raylet's or the object store's socket, or
plant the ready file; so it lives one level below a parent the provider makes 0700 and checks
private, which nobody else can enter. The parent holds a marker naming the state directory it was
made for; a stop removes the parent only when it is private and that marker, owned by this uid, is
found there.

Also here: the directory's lock (starting, leasing and reaping are serialized on it) and the jobs'
leases. Imports neither Airflow nor Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from airflow_provider_batchinfer.launchers.base import LaunchError, TaskLog
from airflow_provider_batchinfer.launchers.embedded.procs import file_lock, proc_alive, proc_start_time
from airflow_provider_batchinfer.store import private_dir

__all__ = [
    "DIR_ENV",
    "add_lease",
    "drop_lease",
    "is_one_off",
    "live_leases",
    "locked",
    "made_for",
    "make_ray_temp_dir",
    "private_state_dir",
    "ray_temp_refused",
    "remove_ray_temp_dir",
    "state_dir",
]

DIR_ENV = "BATCHINFER_RAY_DIR"
ONE_OFF = ".one-off"
TEMP_MARKER = ".batchinfer-state-dir"
#: Ray's temp dir inside the provider's private parent: one letter, Ray's socket paths live below it
RAY_TEMP_NAME = "r"
#: how the private parent's name starts: no other directory is ever taken for one (``/tmp`` itself)
TEMP_PREFIX = "bir-"
_LOG = logging.getLogger(__name__)
#: per process: the fallback chosen for a refused directory, so one task's launcher, lease and
#: spares agree on it (a second mkdtemp would be another Ray)
_FALLBACKS: dict[Path, Path] = {}


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The configured state directory: ``BATCHINFER_RAY_DIR``, else ``/tmp/batchinfer-ray-<uid>``
    (short: Ray's sockets are not here, but its temp dir is a sibling under /tmp for the same
    reason). Not checked: :func:`private_state_dir` is what jobs use."""
    return Path(environ.get(DIR_ENV) or f"/tmp/batchinfer-ray-{os.getuid()}")


def private_state_dir(environ: Mapping[str, str] = os.environ, log: TaskLog | None = None) -> Path:
    """The configured state directory, created 0700 when missing; when it exists and is not private
    (another owner, group or world bits, a symbolic link), a private fallback, with a warning."""
    wanted = state_dir(environ)
    try:
        return private_dir.ensure(wanted)
    except OSError as exc:  # refused, or not creatable (an unwritable parent)
        why = str(exc)
    known = _FALLBACKS.get(wanted)
    fresh = known is None or not _still_private(known)
    fallback = _FALLBACKS[wanted] = _fallback(environ) if fresh or known is None else known
    if log is not None or fresh:
        (log or _LOG).warning(
            "The embedded Ray's state directory %s is not used: %s. This job uses the private directory %s "
            "instead; remove %s or set %s to a directory of your own (mode 0700)",
            wanted,
            why,
            fallback,
            wanted,
            DIR_ENV,
        )
    return fallback


def _still_private(directory: Path) -> bool:
    try:
        private_dir.check(directory)
        return True
    except OSError:
        return False


def _fallback(environ: Mapping[str, str]) -> Path:
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        try:
            private_dir.check(Path(runtime))
            return private_dir.ensure(Path(runtime) / "batchinfer-ray")
        except OSError:
            pass
    one_off = Path(tempfile.mkdtemp(prefix=f"batchinfer-ray-{os.getuid()}-", dir=tempfile.gettempdir()))
    (one_off / ONE_OFF).touch(mode=0o600)
    return one_off


def is_one_off(directory: Path) -> bool:
    """A fallback of one process: its Ray is this task's alone, and nothing is left waiting in it."""
    return (directory / ONE_OFF).exists()


def make_ray_temp_dir(directory: Path) -> str:
    """Ray's temp dir for the Ray of ``directory``: ``<parent>/r``, the parent a fresh ``mkdtemp``
    (this uid, 0700 whatever the umask) checked private and marked as made for ``directory``. Ray
    creates ``r`` itself and makes it world-writable; nobody else can enter the parent to reach it."""
    parent = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp"))  # short: Ray's unix sockets live below it
    private_dir.check(parent)
    fd = os.open(parent / TEMP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as marker:
        marker.write(os.path.abspath(directory))
    return str(parent / RAY_TEMP_NAME)


def ray_temp_refused(temp_dir: str) -> str | None:
    """Why the Ray whose temp dir is ``temp_dir`` is not to be used, or None: its parent must be a
    private directory of this uid (not a symbolic link, no group or other bits), as
    :func:`make_ray_temp_dir` makes it. A Ray started by an earlier version of this package, in a
    temp dir of its own that Ray made world-writable, is refused too."""
    path = Path(temp_dir)
    if not path.is_absolute() or path.name != RAY_TEMP_NAME or not path.parent.name.startswith(TEMP_PREFIX):
        return f"its temp dir {temp_dir} is not inside a private directory of the provider's"
    try:
        private_dir.check(path.parent)
    except OSError as exc:
        return f"its temp dir's parent is not private: {exc}"
    return None


def made_for(temp_dir: str, directory: Path) -> bool:
    """``temp_dir`` is a temp dir that :func:`make_ray_temp_dir` made for the Ray of ``directory``:
    its parent is private (:func:`ray_temp_refused`) and holds this uid's marker naming
    ``directory``. Only such a parent is ever removed."""
    if ray_temp_refused(temp_dir) is not None:
        return False
    try:
        fd = os.open(Path(temp_dir).parent / TEMP_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as marker:
            info = os.fstat(marker.fileno())
            if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode):
                return False
            return marker.read() == os.path.abspath(directory)
    except (OSError, UnicodeDecodeError):
        return False


def remove_ray_temp_dir(temp_dir: str, directory: Path) -> bool:
    """Remove ``temp_dir`` with its private parent when :func:`made_for` says they are the
    provider's, made for the Ray of ``directory``; anything else is left alone."""
    if not made_for(temp_dir, directory):
        return False
    shutil.rmtree(Path(temp_dir).parent, ignore_errors=True)
    return True


# --- the lock and the leases ----------------------------------------------------------------------
def _prepare(directory: Path) -> None:
    """Create the state directory and its leases 0700, or refuse one that is not private. Not a
    permanent failure: the directory may be another user's, and a retry may find it removed (jobs
    get theirs from :func:`private_state_dir`, which falls back instead)."""
    try:
        private_dir.ensure(directory)
        private_dir.ensure(directory / "leases")
    except OSError as exc:
        raise LaunchError(
            f"the embedded Ray's state directory is not used: {exc}; remove it or set {DIR_ENV} "
            "to a directory of your own (mode 0700)"
        ) from None


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the state directory's lock (released by the kernel if this process dies)."""
    _prepare(directory)
    with file_lock(directory / "lock"):
        yield


def mark_used(directory: Path) -> None:
    """Restart the idle clock: the keeper measures idleness from ``last_used``'s mtime."""
    (directory / "last_used").touch()


def live_leases(directory: Path) -> list[int]:
    """Pids of the jobs that hold a lease and still run; stale leases are removed.

    Removing one restarts the idle clock, as :func:`drop_lease` does: the job's process has just
    been seen gone. Without that, a job that ran longer than the idle timeout left a clock still
    at its lease's start, and the keeper stopped Ray the moment the job's process exited, before
    the launcher released the lease (a 47 s job with a 20 s timeout lost its Ray 6 s after it ended).
    """
    live, ended = [], False
    for lease in (directory / "leases").iterdir():
        try:
            pid, started = int(lease.name), int(lease.read_text() or 0)
        except (ValueError, FileNotFoundError):
            pid, started = -1, 0
        if pid > 0 and proc_alive(pid, started):
            live.append(pid)
        else:
            lease.unlink(missing_ok=True)
            ended = True
    if ended:
        mark_used(directory)
    return live


def add_lease(directory: Path, pid: int) -> None:
    """Record that the job in process ``pid`` uses the embedded Ray (call with the lock held)."""
    (directory / "leases" / str(pid)).write_text(str(proc_start_time(pid) or 0))
    mark_used(directory)


def drop_lease(directory: Path, pid: int) -> None:
    """The job in ``pid`` ended: its lease goes and the idle clock restarts."""
    with locked(directory):
        (directory / "leases" / str(pid)).unlink(missing_ok=True)
        mark_used(directory)
