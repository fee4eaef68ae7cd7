"""The job dies with its Airflow task: a watchdog thread in the runtime process.

The ``local`` launcher starts the runtime in its own session (so that ``on_kill`` and a timeout can
stop the whole process group), which also means nothing stops it when the task process itself is
killed (the OOM killer, a lost worker): the job would run on and commit ``_SUCCESS`` later, for a
task Airflow already failed or retried. The launcher therefore puts its own pid in
``BATCHINFER_PARENT_PID``; this thread polls it and, once that process is gone (or this one was
re-parented, which is how its death shows first), says so in one line and SIGKILLs the runtime's own
process group: no commit can follow, and on a private Ray its processes go with it (on a shared Ray
the raylet ends a dead driver's workers itself).

Why polling, not ``prctl(PR_SET_PDEATHSIG)``: the kernel sends that signal when the *thread* that
forked the child exits, not the process; Airflow's task runner and the launcher may start the job
from a short-lived thread, which would kill a healthy job. It also has to be set between fork and
exec (``preexec_fn``, unsafe in a threaded parent). Half a second of polling costs nothing.

Imports neither Airflow nor Ray.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

PARENT_PID_ENV = "BATCHINFER_PARENT_PID"
POLL_S = 0.5


def _alive(pid: int) -> bool:
    """``pid`` runs and is not a zombie (a killed parent stays a zombie until its own parent reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def parent_gone(parent: int, direct: bool) -> bool:
    """The watched process ended: re-parented (when it was our direct parent) or no longer alive."""
    return (direct and os.getppid() != parent) or not _alive(parent)


def _end_job(parent: int) -> None:
    try:
        print(
            f"[batchinfer] the Airflow task process {parent} is gone: stopping this job (nothing is committed)",
            file=sys.stderr,
            flush=True,
        )
    except (OSError, ValueError):
        pass  # the pipe to the task process died with it
    if os.getpgrp() == os.getpid():  # our own session (the launcher's start_new_session): the whole group
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int, direct: bool, poll_s: float) -> None:
    while not parent_gone(parent, direct):
        time.sleep(poll_s)
    _end_job(parent)


def watch_parent(environ: Mapping[str, str] = os.environ, poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watchdog when ``BATCHINFER_PARENT_PID`` names a process (else None: the runtime was
    started some other way, e.g. by the Jobs API, and lives as long as that says)."""
    raw = environ.get(PARENT_PID_ENV, "")
    try:
        parent = int(raw)
    except ValueError:
        return None
    if parent <= 1:
        return None
    direct = os.getppid() == parent
    if not direct and not _alive(parent):
        _end_job(parent)  # gone before we even started
    thread = threading.Thread(target=_watch, args=(parent, direct, poll_s), name="batchinfer-watchdog", daemon=True)
    thread.start()
    return thread
