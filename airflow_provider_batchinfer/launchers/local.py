"""The embedded default: the runtime as a subprocess of the Airflow task, with a local Ray.

A subprocess rather than an in-process call because Ray's driver state, torch threads and model
memory must die with the job, not linger in the worker; and because it is byte-for-byte the same
entrypoint a cluster runs. Its output is streamed line by line into the task log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass

from airflow_provider_batchinfer.runtime.job import ERROR_PREFIX, RESULT_PREFIX


class LaunchError(RuntimeError):
    """The job failed; ``str()`` is the runtime's own last error line. ``permanent``: the runtime
    said no retry can fix it (e.g. S3 access denied), so the task should not be retried."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass
class LocalLauncher:
    ray_address: str | None = None
    kill_grace_s: float = 20.0

    def __post_init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def run(self, spec_location: str, log: logging.Logger, extra_env: dict[str, str] | None = None) -> dict:
        env = dict(os.environ)
        env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"})
        loopback = not self.ray_address or self.ray_address.split(":")[0] in ("127.0.0.1", "localhost")
        if loopback:
            # A single-machine Ray: keep every Ray socket on the loopback interface.
            env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if self.ray_address:
            env["RAY_ADDRESS"] = self.ray_address
            if "RAY_AUTH_MODE" not in env and os.path.exists(os.path.expanduser("~/.ray/auth_token")):
                env["RAY_AUTH_MODE"] = "token"  # Ray >= 2.5x clusters started by `ray start` require it
        env.update(extra_env or {})
        cmd = [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", spec_location]
        log.info("Launching batch inference job: %s%s", " ".join(cmd),
                 f" (Ray at {self.ray_address})" if self.ray_address else " (local Ray)")
        tail: deque[str] = deque(maxlen=40)
        error = result = None
        with self._lock:
            self._proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1,
                start_new_session=True,  # its own process group, so on_kill can stop Ray's children too
            )
        proc = self._proc
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(ERROR_PREFIX):
                error = json.loads(line[len(ERROR_PREFIX):])
                log.error("%s", error["error"])
                continue
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
                continue
            tail.append(line)
            log.info("%s", line)
        code = proc.wait()
        with self._lock:
            self._proc = None
        if code != 0 or result is None:
            if error:
                raise LaunchError(error["error"], permanent=bool(error.get("permanent")))
            last = "\n".join(tail)
            raise LaunchError(f"batch inference job exited with code {code} without a result; last output:\n{last}")
        return result

    def kill(self) -> None:
        """Stop the job and everything it started (used by the operator's on_kill)."""
        with self._lock:
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=self.kill_grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
