"""Real Airflow services for end-to-end tests: api-server, scheduler, dag-processor and triggerer
with the LocalExecutor on SQLite, in a temporary AIRFLOW_HOME, all on 127.0.0.1. Driven only
through public interfaces: the REST API (what the UI calls) and the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import requests

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")


def _utc(date: str) -> str:
    """An ISO date or datetime as an aware UTC datetime (a bare date is its midnight)."""
    parsed = datetime.fromisoformat(date)
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).isoformat()


class AirflowServices:
    def __init__(self, home: Path, port: int, env: dict[str, str]) -> None:
        self.home = home
        self.port = port
        self.env = env
        self.base = f"http://127.0.0.1:{port}"
        self.procs: dict[str, subprocess.Popen] = {}
        # sent with every ``api`` call: a bearer token once ``login`` ran (without
        # ``simple_auth_manager_all_admins`` every route asks for one)
        self.headers: dict[str, str] = {}
        self.restarts: list[str] = []
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="airflow-supervisor", daemon=True)

    # --- life cycle -------------------------------------------------------------------------------------
    def start(self, timeout: float = 180) -> None:
        self.cli("db", "migrate")
        for component in COMPONENTS:
            self.procs[component] = self._spawn(component, mode="w")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"airflow {name} exited: see {self.home / (name + '.log')}")
            try:
                if requests.get(f"{self.base}/api/v2/monitor/health", timeout=15).status_code == 200:
                    self._supervisor.start()
                    return
            except requests.RequestException:  # not listening yet, or busy starting up
                pass
            time.sleep(1)
        raise RuntimeError(f"the api-server did not answer within {timeout}s")

    def _spawn(self, component: str, mode: str) -> subprocess.Popen:
        args = [component] + (["--port", str(self.port), "--host", "127.0.0.1"] if component == "api-server" else [])
        log = open(self.home / f"{component}.log", mode)
        # each in its own process group: stopping the group also stops the executor's workers
        return subprocess.Popen(
            [sys.executable, "-m", "airflow", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _supervise(self) -> None:
        """Start again a component that exited, as systemd or Kubernetes would in a deployment. On
        SQLite a backfill create that meets the write lock half-way deletes the runs it had already
        committed (apache/airflow#68699), and a scheduler holding one of them exits with
        ``ObjectDeletedError``; the scenarios after it need a scheduler. Each restart is recorded
        in ``restarts`` and said in the module's summary."""
        while not self._stopping.wait(2):
            for name, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stopping.is_set():
                    self.restarts.append(f"{name} exited with {proc.returncode} at {time.strftime('%H:%M:%S')}")
                    self.procs[name] = self._spawn(name, mode="a")

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join()
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        # one short grace period, not 30 s each: the tests are over, nothing needs a clean shutdown
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # --- public interfaces ------------------------------------------------------------------------------
    def cli(self, *args: str, attempts: int = 6) -> str:
        """Run an ``airflow`` CLI command. SQLite allows one writer: a command that meets the
        scheduler's write lock ("database is locked") is simply run again."""
        for attempt in range(attempts):
            result = subprocess.run(
                [sys.executable, "-m", "airflow", *args], env=self.env, capture_output=True, text=True, timeout=300
            )
            if result.returncode == 0:
                return result.stdout
            if "database is locked" not in result.stderr + result.stdout or attempt == attempts - 1:
                raise RuntimeError(f"airflow {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
            time.sleep(2 * (attempt + 1))
        raise AssertionError("unreachable")

    def create_backfill(
        self,
        dag_id: str,
        first: str,
        last: str,
        *,
        reprocess: str = "none",
        max_active_runs: int = 10,
        attempts: int = 6,
    ) -> None:
        """A backfill of ``first``..``last`` (ISO dates) created through the REST API, as the UI's
        backfill dialog creates one. The create is not atomic on SQLite: each date's run is
        committed as it is created or cleared (a savepoint per date, which pysqlite releases as a
        commit), so an attempt that meets the scheduler's write lock half-way (503, "Database is
        locked") has taken the first dates and not the rest; one that meets it in the audit log's
        insert, before the create, fails with a 500 that names it. Then the rest is
        created as a backfill of its own once the first one has ended (a DAG may have one open
        backfill), from just after the last date taken. An attempt that took no run left an orphan
        (its row committed, nothing to run): the scheduler would close it only after two minutes,
        so it is cancelled and created again."""
        start = first
        for attempt in range(attempts):
            body = {
                "dag_id": dag_id,
                "from_date": _utc(start),
                "to_date": _utc(last),
                "reprocess_behavior": reprocess,
                "max_active_runs": max_active_runs,
            }
            try:
                self.api("POST", "/backfills", json=body)
                return
            except RuntimeError as exc:
                message = str(exc).lower()
                if start != first and "no runs to create" in message:  # the partial one took the last date
                    return
                if "already a running backfill" in message and attempt < attempts - 1:
                    # seen on a loaded fresh clone right after the one before was closed: the create
                    # still counted it; this attempt took no run, so it is made again once none is open
                    self.wait_for_backfills(dag_id, timeout=900)
                    time.sleep(2 * (attempt + 1))
                    continue
                if "database is locked" not in message or attempt == attempts - 1:
                    raise
            backfills = self.api("GET", "/backfills", params={"dag_id": dag_id})["backfills"]
            left = [b for b in backfills if not b.get("completed_at")]
            taken = [date for b in left for date in self.dates_taken(dag_id, b)]
            if taken:
                self.wait_for_backfills(dag_id, timeout=900)
                start = (max(taken) + timedelta(seconds=1)).isoformat()
                continue
            for b in left:  # an orphan: nothing of it runs, cancelling it touches no run
                self.api("PUT", f"/backfills/{b['id']}/cancel")
            time.sleep(2 * (attempt + 1))

    def dates_taken(self, dag_id: str, backfill: dict[str, Any]) -> list[datetime]:
        """The logical dates whose run a backfill created or cleared (queued): each such run was
        queued after the backfill was created."""
        created = datetime.fromisoformat(backfill["created_at"])
        first, last = datetime.fromisoformat(backfill["from_date"]), datetime.fromisoformat(backfill["to_date"])
        return [
            datetime.fromisoformat(r["logical_date"])
            for r in self.runs(dag_id)
            if r.get("logical_date")
            and r.get("queued_at")
            and first <= datetime.fromisoformat(r["logical_date"]) <= last
            and datetime.fromisoformat(r["queued_at"]) >= created
        ]

    def api(self, method: str, path: str, *, prefix: str = "/api/v2", **kwargs: Any) -> Any:
        """The public REST API; ``prefix="/ui"`` for the endpoints only the UI's pages call."""
        headers = {**self.headers, **kwargs.pop("headers", {})}
        response = requests.request(method, f"{self.base}{prefix}{path}", timeout=60, headers=headers, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response.json() if response.content else None

    def login(self, username: str, password: str) -> str:
        """A JWT for ``username`` from the auth manager's token endpoint (SimpleAuthManager)."""
        body = {"username": username, "password": password}
        return self.api("POST", "/token", prefix="/auth", json=body, headers={})["access_token"]

    def wait_for_dag(self, dag_id: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.api("GET", f"/dags/{dag_id}")
                return
            except RuntimeError:
                time.sleep(1)
        raise RuntimeError(f"dag {dag_id} was not parsed within {timeout}s; see {self.home / 'dag-processor.log'}")

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 420) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(1)
        raise RuntimeError(f"{dag_id} {run_id} did not finish within {timeout}s: {self.task_states(dag_id, run_id)}")

    def wait_for_backfills(self, dag_id: str, timeout: float = 120) -> None:
        """Only one backfill of a DAG may be open. The scheduler closes one up to 30 s after its
        last run ends (a fixed interval in Airflow); one whose every run has ended is closed here
        at once through the REST API, as the UI's cancel does (no run of it is left to cancel)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            backfills = self.api("GET", "/backfills", params={"dag_id": dag_id})["backfills"]
            left = [b for b in backfills if not b.get("completed_at")]
            if not left:
                return
            runs = self.runs(dag_id)
            for b in left:
                first, last = datetime.fromisoformat(b["from_date"]), datetime.fromisoformat(b["to_date"])
                dated = [r for r in runs if r.get("logical_date")]
                if all(
                    r["state"] in ("success", "failed")
                    for r in dated
                    if first <= datetime.fromisoformat(r["logical_date"]) <= last
                ):
                    try:
                        self.api("PUT", f"/backfills/{b['id']}/cancel")
                    except RuntimeError as exc:  # the scheduler closed it meanwhile
                        if "409" not in str(exc):
                            raise
            time.sleep(1)
        raise RuntimeError(f"backfills of {dag_id} still open after {timeout}s")

    def wait_for_defer_exit(self, dag_id: str, run_id: str, task_id: str, timeout: float = 120) -> None:
        """Wait until the scheduler has taken the executor's report of the try that deferred (the
        worker's process exits after ``defer()``, and the executor reports that exit as a success of
        the same try number). Airflow fails a resumed try that is already running when that report
        comes after it, so a trigger that fires within seconds of the deferral (a marker written at
        once) races it on a loaded machine. Nothing but the scheduler's log records the report:
        ``TaskInstance Finished: ... ti_id=<id>, ... state=deferred``."""
        ti_id = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")["id"]
        log = self.home / "scheduler.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in log.read_text(errors="replace").splitlines():
                if "TaskInstance Finished:" in line and f"ti_id={ti_id}," in line and "state=deferred," in line:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the scheduler took no report of {dag_id} {run_id} {task_id}'s deferral in {timeout}s")

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self.api("GET", f"/dags/{dag_id}/dagRuns", params={"limit": 100})["dag_runs"]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, tuple[str, int]]:
        tis = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        return {ti["task_id"]: (ti["state"], ti["try_number"]) for ti in tis}


# A cluster policy, Airflow's own hook (every component imports $AIRFLOW_HOME/config/airflow_local_settings.py):
# a clock-scheduled DAG without an end_date (the example DAGs) ends at its start_date, so the scheduler
# has no run of it due. A manual run has no logical date, so no end_date bounds it.
_NO_CLOCK_RUNS_POLICY = """
from airflow.sdk import (
    CronDataIntervalTimetable,
    CronTriggerTimetable,
    DeltaDataIntervalTimetable,
    DeltaTriggerTimetable,
    MultipleCronTriggerTimetable,
)

CLOCK = (
    CronDataIntervalTimetable,
    CronTriggerTimetable,
    DeltaDataIntervalTimetable,
    DeltaTriggerTimetable,
    MultipleCronTriggerTimetable,
)


def dag_policy(dag):
    if isinstance(dag.timetable, CLOCK) and dag.end_date is None and dag.start_date is not None:
        dag.end_date = dag.start_date
"""


def services_env(
    home: Path,
    port: int,
    bundles: list[dict[str, Any]],
    extra: dict[str, str],
    *,
    asset_triggered_runs: bool = False,
) -> dict[str, str]:
    """The services' environment: their only runs are those a caller asks for (REST triggers,
    backfills). With ``asset_triggered_runs`` the scheduler's own scheduling is on, as the runs an
    asset event triggers need, and ``_NO_CLOCK_RUNS_POLICY`` leaves no clock-scheduled run due; a
    DAG that a caller backfills carries its own ``end_date``: not before the last date backfilled
    (a task whose logical date is past it does not run), and before today."""
    if asset_triggered_runs:
        (home / "config").mkdir(parents=True, exist_ok=True)
        (home / "config" / "airflow_local_settings.py").write_text(_NO_CLOCK_RUNS_POLICY)
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            # SQLite allows one writer; the others wait for its lock up to the driver's timeout (5 s by
            # default, then "database is locked"). On a loaded 2-core machine the scheduler's
            # transactions can hold it longer; a backfill create that fails half-way costs minutes
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}?timeout=30",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__PARALLELISM": "2",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            # only the runs a test creates: no clock-scheduled runs competing for slots (see above)
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": str(asset_triggered_runs),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__TEST_CONNECTION": "Enabled",
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # each DAG file parsed once: no test edits one while the services run, and parsing every
            # file again every 30 s (the default) costs the other tests' CPU
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            # a task's calls to the execution API wait on SQLite's write lock like any writer (up to
            # 30 s, above): with the default 5 s a task whose start meets the lock times out, retries
            # and is killed, and its try is lost
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
            # a task's supervisor waits this long between looks at its process (default 5 s): once
            # the task's sockets close, it sees the exit only at the next look, and meanwhile holds
            # one of the executor's slots and the executor's report (a deferral's included, which
            # ``wait_for_defer_exit`` waits for); it also heartbeats at most this often
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
            # a database error's response names its cause: a request that met SQLite's write lock in
            # the audit log's insert (500, before the request's own work) is told apart and run again
            "AIRFLOW__API__EXPOSE_STACKTRACE": "True",
            "AIRFLOW__API_AUTH__JWT_SECRET": "batchinfer-tests-only",
            "AIRFLOW__API__SECRET_KEY": "batchinfer-tests-only",
        }
    )
    env.update(extra)
    return env
