"""The embedded default: the runtime as a subprocess of the Airflow task, on a warm local Ray.

A subprocess rather than an in-process call because Ray's driver state, torch threads and model
memory must die with the job, not linger in the worker; and because it is byte-for-byte the same
entrypoint a cluster runs. Its output is streamed line by line into the task log. It cannot defer:
the job lives as long as the task process watches it, and no longer (every line is scrubbed of the
credentials the job was given before it is logged): the runtime gets
``BATCHINFER_PARENT_PID`` and its watchdog (``runtime/watchdog.py``) kills the job when this
process is gone (a task killed by the OOM killer must not leave a job that commits later).

Where the job runs:

- a configured address (the connection's host, else ``RAY_ADDRESS``): attach to that Ray; before
  the start, the cluster's Ray version (recorded in its GCS) is compared with this interpreter's, so
  a mismatch fails the task with a clear message instead of a driver that hangs deep in ``ray.init``;
- ``local``: a private Ray started and stopped by the job itself (slow: Ray's start-up every time);
- nothing: the provider's one warm local Ray (``launchers/embedded/embedded_ray.py``), started by the first
  job that needs it, shared by later and concurrent jobs (each holds a lease while it runs) and
  stopped after ``idle_s`` seconds without a job. A job the runtime will score in its own process
  whatever its rows (one CPU replica, ``contract/placement.py``) is started without it: starting Ray
  is most of a small job's cold start, and such a job never uses it. Such a job is handed to a
  spare runtime process that has already imported its model library when one is ready
  (``launchers/embedded/warm_runtime.py``); once it ends, the next spare of its kind is started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from typing import TYPE_CHECKING

from airflow_provider_batchinfer.contract import JobFailure, JobResult, parse_runtime_line, placement
from airflow_provider_batchinfer.contract.lines import EMBEDDED_RAY_READY_ENV
from airflow_provider_batchinfer.launchers.base import (
    FAILED,
    RUNTIME_MODULE,
    STOPPED,
    SUCCEEDED,
    TIMEOUT,
    JobHandle,
    Launcher,
    LauncherConfig,
    LaunchError,
    LogLine,
    Outcome,
    TaskLog,
)
from airflow_provider_batchinfer.launchers.embedded import embedded_ray, warm_runtime
from airflow_provider_batchinfer.store.redact import mask_cut, scrub, secret_values

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from airflow_provider_batchinfer.contract import JobFile

__all__ = ["PARENT_PID_ENV", "LaunchError", "LocalLauncher", "check_ray_version", "cluster_ray_version"]

#: the task process's pid, in the runtime's environment: the runtime's watchdog ends the job with it
PARENT_PID_ENV = "BATCHINFER_PARENT_PID"

# Runs in a fresh interpreter (never in the Airflow worker: importing Ray there is slow and leaves
# threads behind). Prints the cluster's metadata as Ray's own driver check reads it.
_PROBE = """
import json, sys
from ray._raylet import GcsClient
from ray._common.usage.usage_lib import get_cluster_metadata
print(json.dumps(get_cluster_metadata(GcsClient(address=sys.argv[1]))))
"""


def cluster_ray_version(address: str, env: Mapping[str, str], timeout_s: float = 20.0) -> str | None:
    """The Ray version the cluster at ``address`` (a GCS ``host:port``) runs, or None when it cannot
    be told (no GCS there, a Ray Client ``ray://`` or ``auto`` address): then ``ray.init`` decides."""
    if "://" in address or ":" not in address:
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, address], capture_output=True, text=True, env=dict(env), timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        return None
    try:
        return str(json.loads(done.stdout.strip().splitlines()[-1])["ray_version"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def check_ray_version(address: str, cluster: str | None, ours: str) -> None:
    """Raise a permanent LaunchError when the cluster at ``address`` runs another Ray than this worker."""
    if cluster is None or cluster == ours:
        return
    raise LaunchError(
        f"the Ray cluster at {address} runs Ray {cluster}, but this Airflow worker has Ray {ours}; a driver "
        f"cannot attach to a cluster of another Ray version. Install ray=={cluster} on the worker (or run the "
        "cluster on the worker's version), or leave the connection's host empty for the embedded local Ray",
        permanent=True,
    )


class LocalLauncher(Launcher):
    """The runtime as a subprocess. ``ray_address``: attach to that Ray (``"local"``: a private Ray
    per job) instead of the embedded one; ``idle_s``: how long the embedded Ray stays up without a
    job (default ``BATCHINFER_RAY_IDLE_S``, else 600 s)."""

    name = "local"
    deferrable = False

    def __init__(
        self,
        ray_address: str | None = None,
        kill_grace_s: float = 20.0,
        extra_env: Mapping[str, str] | None = None,
        check_version: bool = True,
        idle_s: float | None = None,
    ) -> None:
        self.ray_address = ray_address
        self.idle_s = None if idle_s is None else embedded_ray.idle_seconds(idle_s)
        self.kill_grace_s = kill_grace_s
        self.extra_env = dict(extra_env or {})
        self.check_version = check_version
        self._proc: subprocess.Popen[str] | warm_runtime.WarmProcess | None = None
        self._lock = threading.Lock()
        self._timed_out = False
        self._lease: tuple[Path, int] | None = None
        self._spare_kind: tuple[str, str | None] | None = None  # (flavor, backend): start a spare after
        self._secrets: list[str] = []  # the credentials the job was given: scrubbed from every line it prints

    @classmethod
    def from_config(cls, config: LauncherConfig) -> LocalLauncher:
        from airflow_provider_batchinfer.store.s3 import credential_env

        return cls(
            ray_address=config.ray_address,
            extra_env={**credential_env(dict(config.storage_options)), **config.runtime_secrets},
            idle_s=config.local_ray_idle_s,
        )

    @property
    def job_ray_address(self) -> str | None:
        return self.ray_address

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "RAY_DEDUP_LOGS": "0",
                "RAY_USAGE_STATS_ENABLED": "0",
            }
        )
        loopback = not self.ray_address or self.ray_address.split(":")[0] in ("127.0.0.1", "localhost")
        if loopback:
            # A single-machine Ray: keep every Ray socket on the loopback interface.
            env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if self.ray_address:
            env["RAY_ADDRESS"] = self.ray_address
            if (
                self.ray_address != "local"
                and "RAY_AUTH_MODE" not in env
                and os.path.exists(os.path.expanduser("~/.ray/auth_token"))
            ):
                env["RAY_AUTH_MODE"] = "token"  # Ray >= 2.5x clusters started by `ray start` require it
        env.update(self.extra_env)
        env.update(self.job_secrets)  # a SQL input's database URL: this job's process only
        return env

    def command(self, job_location: str) -> list[str]:
        """The runtime entrypoint, in this worker's interpreter."""
        return [sys.executable, "-m", RUNTIME_MODULE, "--spec", job_location]

    def start(self, job: JobFile, job_location: str, log: TaskLog) -> JobHandle:
        env = self.environment()
        env[PARENT_PID_ENV] = str(os.getpid())
        self._secrets = secret_values(env)
        cmd = self.command(job_location)
        address = self.ray_address or env.get("RAY_ADDRESS")
        if address:
            if self.ray_address and self.check_version:
                ours = embedded_ray.installed_ray_version()
                if ours is not None:
                    check_ray_version(self.ray_address, cluster_ray_version(self.ray_address, env), ours)
            where = "a private local Ray" if address == "local" else f"Ray at {address}"
            log.info("Launching batch inference job: %s (%s)", " ".join(cmd), where)
            self._spawn(cmd, env)
        elif placement.scored_in_driver_whatever_the_rows(job, {**env, placement.EMBEDDED_RAY_ENV: "1"}):
            env[placement.EMBEDDED_RAY_ENV] = "1"  # the embedded default's machine: the driver may score
            env.pop("RAY_AUTH_TOKEN", None)
            self._start_in_driver(job, cmd, env, log)
        else:
            self._start_embedded(cmd, env, log)
        return JobHandle(job_id=job.job_id, attempt=job.attempt)

    def _start_embedded(self, cmd: list[str], env: dict[str, str], log: TaskLog) -> None:
        """Start the job on the embedded Ray: get (or start) it and lease it under one lock, so the
        keeper never stops a Ray between handing out its address and the job's lease. A Ray this job
        starts is started beside the job: the runtime's imports and checks need no Ray, and on a
        small machine they take seconds that Ray's start would otherwise add; the runtime waits for
        the Ray to be up (``EMBEDDED_RAY_READY_ENV``) before it attaches."""
        directory = embedded_ray.private_state_dir(env, log)  # a fallback when the configured one is not private
        idle_s = embedded_ray.idle_seconds(self.idle_s, env)
        env.pop("RAY_AUTH_TOKEN", None)  # the embedded Ray's own token file, never another one
        self._lease = None

        def launch(ray: embedded_ray.EmbeddedRay, starting: bool) -> None:
            env.update(ray.driver_env())
            if starting:
                env[EMBEDDED_RAY_READY_ENV] = str(embedded_ray.ready_file(ray))
            when = ", starting beside the job" if starting else ""
            log.info("Launching batch inference job: %s (embedded Ray at %s%s)", " ".join(cmd), ray.address, when)
            proc = self._spawn(cmd, env)
            embedded_ray.add_lease(directory, proc.pid)
            self._lease = (directory, proc.pid)

        try:
            with embedded_ray.locked(directory):
                # the shared Ray gets this worker's environment, never one job's connection credentials
                version = embedded_ray.installed_ray_version() or "unknown"
                ray = embedded_ray.acquire(directory, idle_s, version, os.environ, log, lambda r: launch(r, True))
                if self._lease is None:  # a Ray that was already up
                    launch(ray, False)
        except BaseException:
            if self._lease is not None:  # started beside a Ray that did not come up: nothing to attach to
                self.kill()
                self._release()  # outside the lock, which dropping the lease takes
            raise

    def _start_in_driver(self, job: JobFile, cmd: list[str], env: dict[str, str], log: TaskLog) -> None:
        """A job scored in the runtime's own process: in a ready spare of its model kind, else in a
        fresh interpreter; either way the next spare is started once it ends (``_release``)."""
        why = "one CPU replica on the embedded default needs no Ray, so none is started for it"
        kind = (job.model.flavor, job.job_spec.backend)
        warm = None
        if warm_runtime.enabled(env) and cmd[:3] == [sys.executable, "-m", RUNTIME_MODULE]:
            self._spare_kind = kind
            warm = warm_runtime.hand_over(cmd[3:], env, *kind, self.spare_environment(), log)
        if warm is None:
            log.info("Launching batch inference job: %s (scored in that process: %s)", " ".join(cmd), why)
            self._spawn(cmd, env)
            return
        log.info(
            "Launching batch inference job: %s in warm runtime process %d, its model library already imported "
            "(scored in that process: %s)",
            " ".join(cmd[3:]),
            warm.pid,
            why,
        )
        with self._lock:
            self._timed_out = False
            self._proc = warm

    def spare_environment(self) -> dict[str, str]:
        """What a spare starts with: this worker's environment, never a connection's credentials nor
        a task's pid (the job's own environment replaces it when the job is handed over)."""
        env = {k: v for k, v in self.environment().items() if k not in self.extra_env}
        for key in (PARENT_PID_ENV, "RAY_AUTH_TOKEN", "RAY_ADDRESS"):
            env.pop(key, None)
        env[placement.EMBEDDED_RAY_ENV] = "1"
        return env

    def _prestart_spare(self) -> None:
        kind, self._spare_kind = self._spare_kind, None
        if kind is None:
            return
        env = self.spare_environment()
        try:
            warm_runtime.prestart(env, *kind, embedded_ray.idle_seconds(self.idle_s, env))
        except (OSError, LaunchError):
            pass  # no spare: the next job starts a fresh interpreter, as without them

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        with self._lock:
            self._timed_out = False
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                text=True,
                bufsize=1,
                start_new_session=True,  # its own process group, so on_kill can stop Ray's children too
            )
            self._proc = proc
            return proc

    def poll(self, handle: JobHandle) -> str | None:
        return None  # its output is the outcome: only wait() reads it

    def wait(
        self, handle: JobHandle, log_line: LogLine, *, poll_interval: float = 1.0, timeout: float | None = None
    ) -> Outcome:
        proc = self._proc
        if proc is None or proc.stdout is None:
            raise LaunchError(f"batch inference job {handle.job_id} was not started by this launcher")
        timer = threading.Timer(timeout, self._expire) if timeout is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        tail: deque[str] = deque(maxlen=40)
        failure: JobFailure | None = None
        result: JobResult | None = None
        try:
            for raw in proc.stdout:
                # the runtime scrubs what it prints; this also covers what native code and child
                # processes write to the same pipe, and a last line cut off mid-secret
                line = scrub(raw.rstrip("\n"), self._secrets)
                if not raw.endswith("\n"):
                    line = mask_cut(line, self._secrets)
                parsed = parse_runtime_line(line)
                if isinstance(parsed, JobFailure):
                    failure = parsed
                    log_line(parsed.error)
                elif isinstance(parsed, JobResult):
                    result = parsed
                else:
                    tail.append(line)
                    log_line(line)
            code = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                self._proc = None
            self._release()
        return self._outcome(handle, code, result, failure, "\n".join(tail), timeout)

    def _release(self) -> None:
        """Give back the embedded Ray's lease: the job ended (its idle clock starts now)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            embedded_ray.drop_lease(*lease)
        self._prestart_spare()

    def _outcome(
        self,
        handle: JobHandle,
        code: int,
        result: JobResult | None,
        failure: JobFailure | None,
        tail: str,
        timeout: float | None,
    ) -> Outcome:
        what = f"batch inference job {handle.job_id}"
        if self._timed_out:
            return Outcome(
                TIMEOUT, failure, f"{what} ran past job_timeout={timeout}s and was stopped; nothing was committed"
            )
        if code == 0 and result is not None:
            return Outcome(SUCCEEDED)
        if failure is not None:
            return Outcome(FAILED, failure, f"{what} failed: {failure.error}")
        status = STOPPED if code < 0 else FAILED
        return Outcome(
            status,
            None,
            f"{what} failed: batch inference job exited with code {code} without a result; last output:\n{tail}",
        )

    def outcome(
        self, handle: JobHandle, status: str, log_line: LogLine | None = None, *, timeout: float | None = None
    ) -> Outcome:
        raise LaunchError(f"the local launcher reports its outcome from wait(), not from a status ({status})")

    def _expire(self) -> None:
        self._timed_out = True
        self.kill()

    def stop(self, handle: JobHandle | None = None) -> bool:
        return self.kill()

    def kill(self) -> bool:
        """Stop the job and everything it started (its whole process group)."""
        with self._lock:
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=self.kill_grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True
