"""Warm runtime processes (``launchers/embedded/warm_runtime.py``, ``runtime/spare.py``): a job the ``local``
launcher scores in the runtime's own process is handed to a spare that has already imported its
model library, and the next spare is started once the job ends. Real launchers, real runtimes, real
spares: each test has its own state directory, so its spares are its own."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, handover
from airflow_provider_batchinfer.contract.specs import InputSpec
from airflow_provider_batchinfer.launchers.base import FAILED, SUCCEEDED, TIMEOUT
from airflow_provider_batchinfer.launchers.embedded import warm_runtime
from airflow_provider_batchinfer.launchers.embedded.procs import proc_alive
from airflow_provider_batchinfer.launchers.local import LocalLauncher
from tests.models import SlowLength, WhereLength, job_file, write_job_file, write_tickets

LOG = logging.getLogger("test_warm_runtime")
SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}


@pytest.fixture
def spares(monkeypatch):
    """This test's own embedded-default state directory (short: sockets live in it); removing it
    at the end makes its waiting spares exit."""
    directory = Path(tempfile.mkdtemp(prefix="bir-w-", dir="/tmp"))
    monkeypatch.setenv("BATCHINFER_RAY_DIR", str(directory))
    monkeypatch.setenv("BATCHINFER_RAY_IDLE_S", "120")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the embedded default: scored in the runtime's process
    monkeypatch.delenv(warm_runtime.ENABLE_ENV, raising=False)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _job(tmp_path, registry, model, name: str, rows: int = 200, bad_row: int | None = None, **params):
    data = write_tickets(tmp_path / f"in-{name}", rows=rows, files=2, bad_row=bad_row)
    run_dir = tmp_path / f"out-{name}"
    run_dir.mkdir()
    spec = InputSpec(id_column="ticket_id", params=params)
    job = job_file(run_dir, model, registry.root, [data], input_spec=spec, attempt=f"t01{name}", job_id=name)
    return run_dir, job, data


def _run(job, launcher: LocalLauncher | None = None, timeout: float | None = None):
    launcher = launcher or LocalLauncher()
    lines: list[str] = []
    records: list[str] = []

    class Log:
        def info(self, msg, *args):
            records.append(msg % args)

        warning = error = info

    handle = launcher.start(job, write_job_file(job), Log())
    outcome = launcher.wait(handle, lines.append, timeout=timeout)
    return outcome, records, lines


def _ready_spares(directory: Path, kind: str) -> list[int]:
    assert warm_runtime.wait_ready(warm_runtime.spares_dir(), timeout=60)
    return [handover.pid_of(p.name) for p in warm_runtime.spares_dir().glob(f"{kind}.*.sock")]


def _gone(pid: int, wait_s: float = 15.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not proc_alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_the_next_job_of_a_kind_runs_in_the_spare_the_last_one_left_with_its_own_environment(
    spares, registry, tmp_path
):
    model = registry.log_model("where_length", "v1", "python", python_class=WhereLength, signature=SIGNATURE)
    pids = tmp_path / "pids"
    pids.mkdir()
    # 1. no spare yet: a fresh interpreter, as before; a spare of its kind is started once it ends
    run_dir, job, _ = _job(tmp_path, registry, model, "first", pid_dir=str(pids))
    outcome, records, _ = _run(job)
    assert outcome.status == SUCCEEDED, outcome.message
    assert not any("warm runtime process" in r for r in records)
    [spare] = _ready_spares(spares, "python-native")
    assert "LENGTH_OFFSET" not in Path(f"/proc/{spare}/environ").read_text()
    # 2. the spare takes the next job: its pid scores it, with the job's environment (a connection's
    # settings reach the job, never the spare that waits), and the output is the same as a fresh run's
    run_dir, job, data = _job(tmp_path, registry, model, "second", pid_dir=str(pids))
    outcome, records, _ = _run(job, LocalLauncher(extra_env={"LENGTH_OFFSET": "1000"}))
    assert outcome.status == SUCCEEDED, outcome.message
    assert any(f"in warm runtime process {spare}, its model library already imported" in r for r in records), records
    assert spare in {int(p.name) for p in pids.iterdir()}
    assert (run_dir / SUCCESS_MARKER).exists()
    out = pq.read_table(run_dir).sort_by("ticket_id")
    texts = pq.read_table(data).sort_by("ticket_id")["text"].to_pylist()
    assert out["length"].to_pylist() == [len(t) + 1000 for t in texts]
    # 3. the spare was the job: it is gone, and a new one waits
    assert _gone(spare)
    [after] = _ready_spares(spares, "python-native")
    assert after != spare


def test_a_failing_job_in_a_spare_fails_with_its_own_error_and_commits_nothing(spares, registry, tmp_path):
    model = registry.log_model("where_length", "v1", "python", python_class=WhereLength, signature=SIGNATURE)
    warm_runtime.prestart(LocalLauncher().spare_environment(), "python", None, 120)
    [spare] = _ready_spares(spares, "python-native")
    run_dir, job, _ = _job(tmp_path, registry, model, "boom", bad_row=7)
    outcome, records, _ = _run(job)
    assert any(f"warm runtime process {spare}" in r for r in records), records
    assert outcome.status == FAILED
    assert "cannot score text 'boom'" in outcome.message
    assert not (run_dir / SUCCESS_MARKER).exists()
    assert not list(run_dir.glob("*.parquet"))


def test_a_job_in_a_spare_past_its_timeout_is_stopped_with_its_process(spares, registry, tmp_path):
    model = registry.log_model("slow_length", "v1", "python", python_class=SlowLength, signature=SIGNATURE)
    warm_runtime.prestart(LocalLauncher().spare_environment(), "python", None, 120)
    [spare] = _ready_spares(spares, "python-native")
    run_dir, job, _ = _job(tmp_path, registry, model, "slow", rows=2000)  # 100 model calls of 0.5 s
    started = time.monotonic()
    outcome, records, _ = _run(job, LocalLauncher(kill_grace_s=5), timeout=4.0)
    assert any(f"warm runtime process {spare}" in r for r in records), records
    assert outcome.status == TIMEOUT and time.monotonic() - started < 30
    assert "nothing was committed" in outcome.message
    assert _gone(spare)
    assert not (run_dir / SUCCESS_MARKER).exists()


def test_turned_off_every_job_starts_a_fresh_interpreter_and_no_spare_waits(spares, registry, tmp_path, monkeypatch):
    monkeypatch.setenv(warm_runtime.ENABLE_ENV, "0")
    model = registry.log_model("where_length", "v1", "python", python_class=WhereLength, signature=SIGNATURE)
    for name in ("one", "two"):
        _, job, _ = _job(tmp_path, registry, model, name)
        outcome, records, _ = _run(job)
        assert outcome.status == SUCCEEDED and not any("warm runtime" in r for r in records)
    assert not (spares / "spares").exists()


def test_a_spare_nobody_claims_exits_when_idle_or_when_its_directory_is_removed(spares):
    env = LocalLauncher().spare_environment()
    idle = warm_runtime.prestart(env, "python", None, idle_s=1.0)
    assert idle is not None
    assert _gone(idle, 20), "an idle spare outlived its idle_s"
    assert not list(warm_runtime.spares_dir().glob("python-native.*.sock"))
    waiting = warm_runtime.prestart(env, "python", None, idle_s=300.0)
    assert waiting is not None and _ready_spares(spares, "python-native") == [waiting]
    shutil.rmtree(spares)
    assert _gone(waiting, 20), "a spare outlived its directory"
    # and the command the demo prints stops one at once
    stopped = warm_runtime.prestart(env, "python", None, idle_s=300.0)
    assert warm_runtime.waiting(spares) == [("python-native", stopped)]
    assert warm_runtime.main(["stop", str(spares)]) == 0
    assert _gone(stopped, 10) and warm_runtime.waiting(spares) == []


def test_one_spare_goes_to_one_launcher_and_a_changed_setup_gets_none(spares, monkeypatch):
    env = LocalLauncher().spare_environment()
    pid = warm_runtime.prestart(env, "python", None, 120)
    assert warm_runtime.prestart(env, "python", None, 120) is None  # one waits (or starts) per kind already
    assert _ready_spares(spares, "python-native") == [pid]
    directory = warm_runtime.spares_dir()
    first = warm_runtime._claim(directory, "python-native")
    assert first is not None and first.name == f"python-native.{pid}.sock.claimed"
    assert warm_runtime._claim(directory, "python-native") is None
    # spares started before a change that matters at import time are never handed a job
    assert warm_runtime.spares_dir({**os.environ, "OMP_NUM_THREADS": "7"}) != directory
    assert warm_runtime.spares_dir({**os.environ, "PYTHONPATH": "/elsewhere"}) != directory
    source = Path(handover.__file__)
    stat = source.stat()
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # this package's code changed
        assert warm_runtime.spares_dir() != directory
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert warm_runtime.spares_dir() == directory
    assert warm_runtime.stop_spares(directory) == 0  # the claimed one is no longer waiting
    os.kill(pid, 9)


def test_a_spare_killed_while_it_waits_is_passed_over_and_the_job_starts_fresh(spares, registry, tmp_path):
    model = registry.log_model("where_length", "v1", "python", python_class=WhereLength, signature=SIGNATURE)
    dead = warm_runtime.prestart(LocalLauncher().spare_environment(), "python", None, 120)
    assert dead is not None and _ready_spares(spares, "python-native") == [dead]
    os.kill(dead, 9)  # its socket file stays behind
    assert _gone(dead)
    run_dir, job, _ = _job(tmp_path, registry, model, "after-kill")
    outcome, records, _ = _run(job)
    assert outcome.status == SUCCEEDED, outcome.message
    assert not any("warm runtime process" in r for r in records), records
    assert (run_dir / SUCCESS_MARKER).exists()
    [fresh] = _ready_spares(spares, "python-native")  # the dead one's files are gone, a new one waits
    assert fresh != dead
    assert sorted(p.name for p in warm_runtime.spares_dir().glob("*.sock*")) == [f"python-native.{fresh}.sock"]


def test_kill_9_of_a_spare_running_a_job_fails_the_try_and_commits_nothing(spares, registry, tmp_path):
    model = registry.log_model("slow_length", "v1", "python", python_class=SlowLength, signature=SIGNATURE)
    warm_runtime.prestart(LocalLauncher().spare_environment(), "python", None, 120)
    [spare] = _ready_spares(spares, "python-native")
    run_dir, job, _ = _job(tmp_path, registry, model, "killed", rows=2000)  # 100 model calls of 0.5 s
    launcher = LocalLauncher()
    handle = launcher.start(job, write_job_file(job), LOG)
    lines: list[str] = []

    def kill_when_scoring(line: str) -> None:
        lines.append(line)
        if "rows in the driver process" in line:
            os.kill(spare, 9)

    outcome = launcher.wait(handle, kill_when_scoring)
    assert any("rows in the driver process" in line for line in lines)
    assert not outcome.succeeded
    assert "exited with code -9 without a result" in outcome.message
    assert not (run_dir / SUCCESS_MARKER).exists()
