"""Reproduce, on purpose, what made the services tests flaky, and check that their helpers hold:
``python -m tests.sqlite_backfill_check`` (about 3 minutes, real Airflow services on 127.0.0.1).

1. On SQLite, a backfill create (here through the REST API, as the UI makes one) commits each
   date's run as it goes (apache/airflow#68699).
   Here SQLite's write lock is held for 40 s as soon as the first date is committed, so the create
   fails half-way; ``AirflowServices.create_backfill`` must still end with every date run once (a
   create), or every run cleared once more (a reprocess).
2. A scheduler that exits is started again, and a run triggered after it succeeds. Holding the lock
   for 40 s (past the services' 30 s SQLite timeout) already made the scheduler exit (status 1) in
   the runs here; then it is killed with ``kill -9`` on purpose.

Not part of ``make test``: it only exercises the test helpers, and takes minutes of the suite's
time for a path that a normal run meets rarely. Exits 0 when every check holds."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.airflow_services import AirflowServices, services_env
from tests.conftest import _free_port

DAG_ID = "sqlite_check_daily"
DAG_FILE = f'''
import time

import pendulum
from airflow.sdk import dag, task


@dag(dag_id="{DAG_ID}", schedule="@daily", start_date=pendulum.datetime(2026, 11, 1, tz="UTC"), catchup=False)
def sqlite_check():
    @task
    def work():
        time.sleep(3)

    work()


sqlite_check()
'''
DATES = ("2026-11-01", "2026-11-04")


def hold_the_lock_after_the_first_date(db: Path, seconds: float = 40) -> None:
    """Wait until the newest backfill has committed one date, then hold SQLite's write lock."""
    conn = sqlite3.connect(db, timeout=60, isolation_level=None)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        taken = conn.execute(
            "SELECT count(*) FROM backfill_dag_run WHERE backfill_id = (SELECT max(id) FROM backfill)"
        ).fetchone()[0]
        if taken:
            conn.execute("BEGIN IMMEDIATE")
            time.sleep(seconds)
            conn.execute("COMMIT")
            return
        time.sleep(0.005)
    raise RuntimeError("the backfill committed no date within 120 s")


def tries_per_date(s: AirflowServices) -> dict[str, int]:
    runs = {r["logical_date"][:10]: r["dag_run_id"] for r in s.runs(DAG_ID)}
    for run_id in runs.values():
        assert s.wait_for_run(DAG_ID, run_id) == "success", s.task_states(DAG_ID, run_id)
    return {date: s.task_states(DAG_ID, run_id)["work"][1] for date, run_id in sorted(runs.items())}


def check_backfills(s: AirflowServices, db: Path) -> None:
    for reprocess, expected_try in (("none", 1), ("completed", 2)):
        holder = threading.Thread(target=hold_the_lock_after_the_first_date, args=(db,))
        holder.start()
        s.create_backfill(DAG_ID, *DATES, reprocess=reprocess)
        holder.join()
        s.wait_for_backfills(DAG_ID, timeout=300)
        tries = tries_per_date(s)
        what = "reprocess" if reprocess != "none" else "create"
        backfills = [
            f"#{b['id']} from {b['from_date'][:19]}"
            for b in s.api("GET", "/backfills", params={"dag_id": DAG_ID})["backfills"]
        ]
        print(f"{what}: try per date {tries}; backfills so far: {', '.join(backfills)}", flush=True)
        assert tries == {f"2026-11-0{d}": expected_try for d in range(1, 5)}, tries


def check_restart(s: AirflowServices) -> None:
    old = s.procs["scheduler"].pid
    os.killpg(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while s.procs["scheduler"].pid == old and time.monotonic() < deadline:
        time.sleep(0.5)
    assert s.procs["scheduler"].pid != old, "the scheduler was not started again"
    run_id = s.trigger(DAG_ID)
    assert s.wait_for_run(DAG_ID, run_id, timeout=180) == "success"
    print(f"scheduler started again ({'; '.join(s.restarts)}); a run after it succeeded", flush=True)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="sqlite-check-"))
    (root / "dags").mkdir()
    (root / "dags" / "sqlite_check.py").write_text(DAG_FILE)
    home = root / "airflow"
    home.mkdir()
    port = _free_port()
    bundle = {
        "name": "sqlite_check",
        "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
        "kwargs": {"path": str(root / "dags"), "refresh_interval": 0},
    }
    s = AirflowServices(home, port, services_env(home, port, [bundle], {}))
    s.start()
    try:
        s.wait_for_dag(DAG_ID)
        check_backfills(s, home / "airflow.db")
        check_restart(s)
    finally:
        s.stop()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
