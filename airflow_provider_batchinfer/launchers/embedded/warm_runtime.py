"""Warm runtime processes for the embedded default: hand a job to a spare that has already imported
its model library (``runtime/spare.py`` says why and how), and start the next spare once a job ends.

Only for jobs the ``local`` launcher scores in the runtime's own process with no Ray (one CPU
replica on the embedded default): there the imports are most of a small job and a third of a 1M-row
tabular one. A job on Ray imports its library in Ray's workers, which a spare cannot warm.

Spares live in ``<embedded Ray state dir>/spares/<fingerprint>``, private directories of this user
(``store/private_dir.py``; the state directory is the embedded Ray's, its fallback included, and
a one-off fallback gets no spares: no later job would find them). A launcher sends a job, its
credentials included, only to the process its claimed socket's name says: the listener's
``SO_PEERCRED`` must show that pid and this uid.
The fingerprint covers the interpreter, this package's source files and the environment variables
read when a library is imported (``PYTHONPATH``, thread counts, ``LD_PRELOAD``…): a spare started
before a change is never handed a job; it sits out its ``idle_s`` (the embedded Ray's idle timeout)
and exits. ``BATCHINFER_WARM_RUNTIME=0`` turns spares off (each job in a fresh interpreter).

Imports neither Airflow nor Ray.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from airflow_provider_batchinfer.contract import handover
from airflow_provider_batchinfer.launchers.base import TaskLog
from airflow_provider_batchinfer.launchers.embedded import embedded_ray
from airflow_provider_batchinfer.launchers.embedded.procs import file_lock, proc_alive
from airflow_provider_batchinfer.store import private_dir

__all__ = ["ENABLE_ENV", "WarmProcess", "enabled", "hand_over", "prestart", "spares_dir", "stop_spares", "wait_ready"]

ENABLE_ENV = "BATCHINFER_WARM_RUNTIME"
SPARE_MODULE = "airflow_provider_batchinfer.runtime.spare"
#: read when a library is imported (or by the interpreter itself): a spare started under other
#: values would run the job differently from a fresh process
_IMPORT_TIME_ENV = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)
#: a Unix socket's path must fit in 107 bytes; beyond this, no spares (jobs start as before)
_MAX_SOCKET_PATH = 107
_LOG = logging.getLogger(__name__)


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _package_stamp() -> str:
    """This package's source files (path, size, mtime): a spare never runs code older than the job's."""
    root = Path(handover.__file__).resolve().parents[1]
    digest = hashlib.sha256(str(root).encode())
    for path in sorted(root.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def fingerprint(environ: Mapping[str, str]) -> str:
    digest = hashlib.sha256(f"{sys.executable}\n{sys.version}\n{_package_stamp()}".encode())
    for key in _IMPORT_TIME_ENV:
        digest.update(f"\n{key}={environ.get(key, '')}".encode())
    return digest.hexdigest()[:16]


def spares_dir(environ: Mapping[str, str] = os.environ, log: TaskLog | None = None) -> Path:
    """Where spares for this setup wait: below the embedded Ray's private state directory."""
    return embedded_ray.private_state_dir(environ, log) / "spares" / fingerprint(environ)


def _spares_wanted(directory: Path) -> bool:
    return not embedded_ray.is_one_off(directory.parent.parent)


def kind_of(flavor: str, backend: str | None) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{flavor}-{backend or 'native'}")


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    for level in (directory.parent.parent, directory.parent, directory):  # state dir, spares/, <fingerprint>/
        private_dir.ensure(level)  # no level another user could write to or link elsewhere
    with file_lock(directory / "lock"):
        yield


def _ready(directory: Path, kind: str) -> list[Path]:
    return [p for p in directory.glob(f"{kind}.*.sock") if proc_alive(handover.pid_of(p.name))]


def _starting(directory: Path, kind: str = "*") -> list[Path]:
    return [p for p in directory.glob(f"{kind}.*.sock.starting") if proc_alive(handover.pid_of(p.name))]


def _forget_the_dead(directory: Path) -> None:
    """Remove the files of spares that died (killed while waiting or importing)."""
    for path in [*directory.glob("*.sock"), *directory.glob("*.sock.starting"), *directory.glob("*.sock.claimed")]:
        if not proc_alive(handover.pid_of(path.name)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


# --- a job in a spare ------------------------------------------------------------------------------
class WarmProcess:
    """A job running in a spare: the part of ``subprocess.Popen`` the ``local`` launcher uses.
    The spare is not this process's child; its exit code comes over the hand-over connection
    (read under a lock: the launcher's timeout thread may wait while the task's thread does)."""

    def __init__(self, pid: int, stdout_fd: int, conn: socket.socket, pending: bytes = b"") -> None:
        self.pid = pid
        self.stdout = open(stdout_fd, encoding="utf-8", errors="replace")
        self.returncode: int | None = None
        self._conn = conn
        self._pending = pending
        self._lock = threading.Lock()

    def _read(self, timeout: float) -> None:
        """Read the spare's lines for up to ``timeout`` seconds; set ``returncode`` at its exit."""
        while self.returncode is None and b"\n" not in self._pending:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return
            chunk = self._conn.recv(4096)
            if not chunk:  # closed without an exit line: the process was killed
                self._finish(-signal.SIGKILL)
                return
            self._pending += chunk
        while self.returncode is None and b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self._finish(int(message["exit"]))

    def _finish(self, code: int) -> None:
        self.returncode = code
        self._conn.close()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._read(0)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self.returncode is None:
                    self._read(0.2)
                if self.returncode is not None:
                    return self.returncode
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"warm runtime process {self.pid}", timeout or 0.0)


def _claim(directory: Path, kind: str) -> Path | None:
    for path in sorted(_ready(directory, kind)):
        target = path.with_name(handover.claimed_name(path.name))
        try:
            os.rename(path, target)  # atomic: exactly one launcher wins each spare
        except FileNotFoundError:
            continue  # another launcher's, or retired
        return target
    return None


def _check_peer(conn: socket.socket, claimed: Path) -> None:
    """The listener is the spare the socket's name says, of this uid: else nothing is sent to it."""
    pid, uid, _gid = handover.peer_credentials(conn)
    expected = handover.pid_of(claimed.name)
    if uid != os.getuid() or pid != expected:
        raise PermissionError(
            f"the process listening on {claimed} is pid {pid} of uid {uid}, not spare {expected} of uid "
            f"{os.getuid()}; nothing was sent to it"
        )


def hand_over(
    args: list[str],
    env: Mapping[str, str],
    flavor: str,
    backend: str | None,
    environ: Mapping[str, str],
    log: TaskLog | None = None,
) -> WarmProcess | None:
    """Run the job in a ready spare of its kind; None when there is none (start it as before)."""
    try:
        directory = spares_dir(environ, log)
    except OSError:  # no private state directory at all: the job starts as without spares
        return None
    if not directory.is_dir() or not _spares_wanted(directory):
        return None
    try:
        with _locked(directory):
            claimed = _claim(directory, kind_of(flavor, backend))
    except OSError:  # not ours, unwritable: the job starts as without spares
        return None
    if claimed is None:
        return None
    read_fd, write_fd = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(30)
        conn.connect(str(claimed))
        _check_peer(conn, claimed)
        request = handover.encode_request({"args": args, "env": dict(env), "cwd": os.getcwd()})
        socket.send_fds(conn, [request], [write_fd])
        os.close(write_fd)
        write_fd = -1
        reply = b""
        while b"\n" not in reply:
            chunk = conn.recv(4096)
            if not chunk:
                raise ConnectionError("the spare closed the connection before it took the job")
            reply += chunk
        first, rest = reply.split(b"\n", 1)
        message = json.loads(first)
        if "pid" not in message:
            raise ConnectionError(f"the spare refused the job: {message.get('refused', message)}")
        conn.settimeout(None)
    except (OSError, ValueError) as exc:
        # nothing ran: the spare takes on the job only after it has answered with its pid
        (log or _LOG).warning("Not handing the job to spare %s (%s); it starts in a fresh process", claimed, exc)
        conn.close()
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        with contextlib.suppress(FileNotFoundError):
            claimed.unlink()
        return None
    return WarmProcess(int(message["pid"]), read_fd, conn, rest)


# --- spares ---------------------------------------------------------------------------------------
def prestart(env: Mapping[str, str], flavor: str, backend: str | None, idle_s: float) -> int | None:
    """Start a spare of this kind unless one is ready or starting; its pid, or None."""
    directory = spares_dir(env)
    kind = kind_of(flavor, backend)
    longest = directory / f".{handover.socket_name(kind, 4_194_304)}.binding"  # the largest pid Linux gives
    if len(str(longest).encode()) > _MAX_SOCKET_PATH or idle_s <= 0 or not _spares_wanted(directory):
        return None
    with _locked(directory):
        _forget_the_dead(directory)
        if _ready(directory, kind) or _starting(directory, kind):
            return None
        with open(directory / "spares.log", "ab") as log:
            command = [sys.executable, "-m", SPARE_MODULE, "--dir", str(directory), "--kind", kind]
            command += ["--flavor", flavor, "--backend", backend or "", "--idle-s", str(idle_s)]
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,  # its own process group: a job in it is stopped by its group
            )
        (directory / handover.starting_name(handover.socket_name(kind, proc.pid))).touch()
    return proc.pid


def wait_ready(directory: Path, timeout: float = 60.0) -> bool:
    """Wait until no spare in ``directory`` is still importing (benchmarks: nothing runs beside)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not directory.is_dir() or not _starting(directory):
            return True
        time.sleep(0.1)
    return False


def stop_spares(directory: Path) -> int:
    """Stop every waiting spare in ``directory`` (a job already handed over runs on); how many."""
    stopped = 0
    if not directory.is_dir():
        return 0
    with _locked(directory):
        for path in [*directory.glob("*.sock"), *directory.glob("*.sock.starting")]:
            pid = handover.pid_of(path.name)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            if proc_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 15)
                    stopped += 1
    return stopped


def waiting(state_directory: Path) -> list[tuple[str, int]]:
    """``(kind, pid)`` of every spare under an embedded-default state directory, ready or importing."""
    found = []
    for path in sorted((state_directory / "spares").glob("*/*.sock*")):
        if path.name.endswith((".sock", ".sock.starting")) and proc_alive(handover.pid_of(path.name)):
            found.append((path.name.split(".")[0], handover.pid_of(path.name)))
    return found


def main(argv: list[str]) -> int:
    """``python -m airflow_provider_batchinfer.launchers.embedded.warm_runtime stop [state dir]``."""
    if argv[:1] == ["stop"] and len(argv) <= 2:
        root = Path(argv[1]) if len(argv) == 2 else embedded_ray.private_state_dir()  # its fallback included
        stopped = sum(stop_spares(d) for d in sorted((root / "spares").glob("*")))
        print(f"stopped {stopped} spare runtime process(es) under {root / 'spares'}")
        return 0
    print(
        "usage: python -m airflow_provider_batchinfer.launchers.embedded.warm_runtime stop [state dir]", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
