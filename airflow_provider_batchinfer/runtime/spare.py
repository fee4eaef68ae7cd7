"""A spare runtime process: the runtime's entrypoint with its model library already imported,
waiting for the next job of its kind.

Why: on the embedded default a job scored in its own process spends most of a small or tabular
job before its first row: a fresh interpreter, the runtime's modules, then the model library
(torch ~1.1 s, xgboost ~1.1 s, lightgbm ~1.5 s, sentence-transformers several seconds). For a
1M-row MLP that is a third of the job, paid again by every run. Ray prestarts its worker processes
for the same reason. The ``local`` launcher (``launchers/embedded/warm_runtime.py``) starts one spare per
model kind after a job of that kind ends; the next job of that kind is handed to it.

Why a waiting process and not a fork server: forking a process that has imported numpy, pyarrow or
torch copies their native thread pools (OpenBLAS and jemalloc start threads at import). A spare is
an ordinary ``python`` started by exec, so a job in it runs as in a fresh one, its imports done.

The hand-over, over one Unix socket in a private directory of its owner (``store/private_dir.py``:
0700, not a symbolic link; checked before the spare listens):

1. the spare imports, then binds ``<dir>/<kind>.<pid>.sock`` (under a temporary name, renamed when
   listening: a socket that exists is ready);
2. a launcher claims it by renaming that file to ``….claimed`` (atomic: one launcher wins),
   connects, checks that the listener is this spare (``SO_PEERCRED``: the pid in the name, the
   launcher's uid), and only then sends one length-prefixed JSON request ``{args, env, cwd}`` with
   the job's output pipe attached (``SCM_RIGHTS``); the spare checks the launcher's uid likewise;
3. the spare answers ``{"pid": …}`` and becomes the job: its output to that pipe, the job's
   environment, working directory and arguments, the watchdog armed as in a fresh runtime;
4. when the job ends it sends ``{"exit": code}`` and leaves with ``os._exit(code)``. The
   connection closing without that line means the process was killed.

A spare nobody claims exits after ``idle_s`` seconds, or as soon as its directory is removed.
Imports neither Airflow nor Ray.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.contract import handover
from airflow_provider_batchinfer.store import private_dir

#: the libraries each model kind imports when it loads; a spare imports them before it waits
_LIBRARIES = {
    "torchscript": ("torch",),
    "sentence_transformers": ("torch", "sentence_transformers"),
    "image_classification": ("torch",),
    "xgboost": ("xgboost",),
    "lightgbm": ("lightgbm",),
    "sklearn": ("sklearn",),
    "onnx": ("onnxruntime",),
}
#: JobSpec.backend="onnx" | "onnx_int8": a job on the cached export needs ONNX Runtime, not torch
_OPTIMIZED_LIBRARIES = ("onnxruntime",)
_RUNTIME_MODULES = (
    "airflow_provider_batchinfer.runtime.reporting",
    "airflow_provider_batchinfer.runtime.driver",
    "airflow_provider_batchinfer.runtime.engine.in_driver",
    "airflow_provider_batchinfer.runtime.watchdog",
    "pyarrow.parquet",
)
POLL_S = 2.0
#: how long a claimed spare waits for its launcher to connect before it gives up
CLAIM_GRACE_S = 30.0


def libraries(flavor: str, backend: str | None) -> tuple[str, ...]:
    """What a job of this model kind imports before its first row (nothing known: none)."""
    return _OPTIMIZED_LIBRARIES if backend else _LIBRARIES.get(flavor, ())


def preload(flavor: str, backend: str | None) -> list[str]:
    """Import the runtime and the kind's libraries; the ones that failed (the job will say why)."""
    from airflow_provider_batchinfer.runtime.model.flavors import adapter_module

    names = [*_RUNTIME_MODULES, *libraries(flavor, backend)]
    adapter = adapter_module(flavor)
    if not backend and adapter:
        names.append(adapter)
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing extra: the job itself reports it with its own message
            failed.append(f"{name}: {exc}")
    return failed


# --- the wire -------------------------------------------------------------------------------------
def send_message(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(handover.encode_message(message))


def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One length-prefixed JSON request and the descriptors sent with its first bytes."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 1)
    while (length := handover.request_length(data)) is None or len(data) < length:
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the launcher closed the connection before its request was complete")
        data += more
    return handover.decode_request(data[:length]), list(fds)


def _same_user(conn: socket.socket) -> bool:
    """Only this user's launchers may hand a job to this process (the directory is 0700 as well)."""
    _pid, uid, _gid = handover.peer_credentials(conn)
    return uid == os.getuid()


# --- waiting ----------------------------------------------------------------------------------------
def _listen(directory: Path, name: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    binding = directory / f".{name}.binding"
    with contextlib.suppress(FileNotFoundError):
        binding.unlink()
    listener.bind(str(binding))
    listener.listen(1)
    os.rename(binding, directory / name)  # ready: only now can a launcher see it
    listener.settimeout(POLL_S)
    return listener


def _wait_for_job(directory: Path, name: str, idle_s: float) -> socket.socket | None:
    """The connection of the launcher that claimed this spare, or None: idle, directory gone."""
    listener = _listen(directory, name)
    deadline = time.monotonic() + idle_s
    claimed_at: float | None = None
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            now = time.monotonic()
            if not directory.is_dir():
                return None  # removed (the embedded default's state cleared): nobody can claim it
            if claimed_at is not None:
                if now - claimed_at >= CLAIM_GRACE_S:  # claimed by a launcher that never came
                    with contextlib.suppress(FileNotFoundError):
                        (directory / handover.claimed_name(name)).unlink()
                    return None
                continue
            if now < deadline:
                continue
            try:
                (directory / name).unlink()  # retired: no launcher can claim it any more
                return None
            except FileNotFoundError:
                claimed_at = now  # a launcher renamed it first: it is about to connect
                continue
        if _same_user(conn):
            listener.close()
            return conn
        conn.close()


# --- becoming the job -------------------------------------------------------------------------------
def _become(request: dict[str, Any], out_fd: int) -> list[str]:
    """Take on the job's output, directory, environment and import path; the runtime's arguments."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    cwd = str(request["cwd"])
    os.chdir(cwd)
    env = {str(k): str(v) for k, v in request["env"].items()}
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = cwd  # `python -m` puts the working directory first
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    args = [str(a) for a in request["args"]]
    sys.argv = ["airflow_provider_batchinfer.runtime", *args]
    return args


def _run_job(conn: socket.socket) -> None:
    """Run the job handed over on ``conn`` and leave; never returns."""
    from airflow_provider_batchinfer.runtime.reporting import main
    from airflow_provider_batchinfer.runtime.watchdog import watch_parent

    conn.settimeout(30)
    request, fds = _receive_request(conn)
    if len(fds) != 1:
        send_message(conn, {"refused": f"expected the job's output pipe with the request, got {len(fds)} descriptors"})
        os._exit(2)
    conn.settimeout(None)
    args = _become(request, fds[0])
    send_message(conn, {"pid": os.getpid()})
    code = 1
    try:
        watch_parent()
        code = main(args)
    except BaseException:  # the runtime reports its own failures; this is the last resort
        traceback.print_exc()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        send_message(conn, {"exit": code})
    os._exit(code)


def serve(directory: Path, kind: str, flavor: str, backend: str | None, idle_s: float) -> int:
    started = time.monotonic()
    failed = preload(flavor, backend)
    name = handover.socket_name(kind, os.getpid())
    print(
        f"{time.ctime()} spare {os.getpid()} ({kind}): imports done in {time.monotonic() - started:.2f}s"
        + (f"; not imported: {'; '.join(failed)}" if failed else ""),
        flush=True,
    )
    with contextlib.suppress(FileNotFoundError):
        (directory / handover.starting_name(name)).unlink()
    try:
        private_dir.check(directory)  # its socket is where launchers send jobs' credentials
    except OSError as exc:
        print(f"{time.ctime()} spare {os.getpid()} ({kind}): not listening: {exc}", flush=True)
        return 1
    conn = _wait_for_job(directory, name, idle_s)
    if conn is None:
        print(f"{time.ctime()} spare {os.getpid()} ({kind}): not needed; exiting", flush=True)
        return 0
    _run_job(conn)
    return 1  # not reached


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m airflow_provider_batchinfer.runtime.spare")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--kind", required=True)
    parser.add_argument("--flavor", required=True)
    parser.add_argument("--backend", default="")
    parser.add_argument("--idle-s", type=float, required=True)
    args = parser.parse_args(argv)
    return serve(Path(args.dir), args.kind, args.flavor, args.backend or None, args.idle_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
