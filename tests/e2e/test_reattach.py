"""A lost worker does not cost the job: a ray_jobs job belongs to its task instance and to what it
computes (its identity), not to a try. Against the session's real ``ray start --head`` cluster, with
the task run in a real subprocess that is ``kill -9``-ed (or that dies right before or after its
submit): the next try re-attaches to the same Ray job when its identity is unchanged, and stops it
and starts anew when the input changed. Plus the identity's own rules, without a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JobFile, RunOwner
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, SaveMode
from airflow_provider_batchinfer.launchers.ray_jobs import belongs_to, job_metadata, submission_id_for
from airflow_provider_batchinfer.store.identity import (
    job_identity,
    parquet_fingerprint,
    result_identity,
    sql_fingerprint,
    task_key,
)
from tests.e2e import test_ray_jobs
from tests.e2e.test_ray_jobs import jobs_of_run
from tests.models import committed_manifest, write_tickets
from tests.runs import job_file
from tests.task_context import TaskInstanceStandIn

# the cluster connection and a launcher on it: the ray_jobs tests' own fixtures
ray_jobs_conn, launcher = test_ray_jobs.ray_jobs_conn, test_ray_jobs.launcher

REPO = Path(__file__).resolve().parents[2]
OWNER = RunOwner(dag_id="d", task_id="t", run_id="scheduled__2026-11-01", try_number=1)

# A model whose job runs exactly as long as a test needs: a batch that holds the text
# ``wait-for:<path>`` is scored once that path exists (the gate travels with the data, as
# TextLength's injected faults do, so it reaches the Ray workers wherever they run). Logged from
# this source (``gated_model``), since a test module is no module a Ray worker should import.
GATED_MODEL = """
import os, time


class GatedLength:
    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch):
        for text in batch["text"]:
            while text.startswith("wait-for:") and not os.path.exists(text[len("wait-for:"):]):
                time.sleep(0.1)
        return {"length": batch["text"].str.len().to_numpy()}
"""


@pytest.fixture
def gated_model(registry, tmp_path):
    source = tmp_path / "gated_length.py"
    source.write_text(GATED_MODEL)
    return registry.log_model(
        "gated_length",
        "v1",
        "python",
        python_class="gated_length:GatedLength",
        code_paths=[str(source)],
        signature={"inputs": {"text": "string"}, "outputs": {"length": "int64"}},
    )


def gated_tickets(directory: Path, rows: int, files: int, gate: Path | None) -> Path:
    """``write_tickets``, with the first ticket's text ``wait-for:<gate>`` (no gate: none held)."""
    write_tickets(directory, rows=rows, files=files)
    if gate is not None:
        first = directory / "tickets-00.parquet"
        table = pq.read_table(first)
        texts = table.column("text").to_pylist()
        texts[0] = f"wait-for:{gate}"
        pq.write_table(table.set_column(1, "text", pa.array(texts)), first)
    return directory


# one task try, as a worker runs it: builds the operator and executes it. ``die`` injects the loss
# of the worker at the two points around the submit (the process ends at once, no clean-up runs)
TRY_SCRIPT = r"""
import json, os, sys
args = json.loads(sys.argv[1])
if args.get("die"):
    from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsLauncher
    submit = RayJobsLauncher.submit
    def dying_submit(self, *a, **k):
        if args["die"] == "after_submit":
            submit(self, *a, **k)
        os._exit(137)
    RayJobsLauncher.submit = dying_submit
from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec
from tests.task_context import TaskInstanceStandIn
op = BatchInferenceOperator(
    task_id="infer", model="gated_length", version="v1", input=args["input"],
    output_spec=OutputSpec(stage_location=args["out"]), job_spec=JobSpec(max_batch_rows=50), poll_interval=0.5,
)
op.execute({"ti": TaskInstanceStandIn(run_id=args["run_id"], try_number=args["try_number"])})
"""


def _identity(owner=OWNER, fingerprint=None, sha="a" * 64, job_spec=None, mode=SaveMode.OVERWRITE) -> str:
    result = result_identity(
        input_fingerprint=fingerprint if fingerprint is not None else [["/in/a.parquet", 10, 1]],
        model_sha256=sha,
        input_spec=InputSpec(),
        job_spec=job_spec or JobSpec(),
    )
    return job_identity(
        owner,
        run_dir="/stage/out",
        result=result,
        model="m/v1",
        input_spec=InputSpec(),
        job_spec=job_spec or JobSpec(),
        save_mode=mode,
    )


# --- the identity, without a cluster ------------------------------------------------------------------


def test_the_identity_is_the_task_instance_and_what_it_computes_not_the_try():
    base = _identity()
    assert len(base) == 64 and int(base, 16) >= 0  # sha256 hex: 256 bits
    assert _identity(owner=RunOwner("d", "t", OWNER.run_id, try_number=7)) == base
    changed = [
        _identity(owner=RunOwner("d", "t", OWNER.run_id, try_number=1, map_index=3)),
        _identity(owner=RunOwner("d", "t", "scheduled__2026-11-02", try_number=1)),
        _identity(fingerprint=[["/in/a.parquet", 11, 1]]),  # a file changed size
        _identity(fingerprint=[["/in/a.parquet", 10, 2]]),  # ... or was rewritten
        _identity(fingerprint=sql_fingerprint("select 1", "pg")),
        _identity(sha="b" * 64),
        _identity(job_spec=JobSpec(max_batch_rows=7)),
        _identity(mode=SaveMode.RESUME),
    ]
    assert len({base, *changed}) == len(changed) + 1
    assert sql_fingerprint("select 1", "pg") != sql_fingerprint("select 2", "pg")
    assert task_key(OWNER) == task_key(RunOwner("d", "t", OWNER.run_id, try_number=2)) and len(task_key(OWNER)) == 32


def test_the_parquet_fingerprint_sees_a_rewritten_file(tmp_path):
    inputs = write_tickets(tmp_path / "in", rows=40, files=2)
    (inputs / "_SUCCESS").write_text("{}")  # not input: never read, never fingerprinted
    first = parquet_fingerprint([str(inputs)], None)
    assert [Path(loc).name for loc, _size, _mtime in first] == ["tickets-00.parquet", "tickets-01.parquet"]
    assert parquet_fingerprint([str(inputs)], None) == first
    time.sleep(0.01)
    write_tickets(tmp_path / "in", rows=40, files=2)  # same names, same sizes: rewritten
    assert parquet_fingerprint([str(inputs)], None) != first


def test_the_job_file_records_the_identity_and_older_ones_still_read(tmp_path):
    job = job_file(tmp_path)
    recorded = JobFile(**{**job.__dict__, "identity": "c" * 64, "submission_id": "sid"})
    assert JobFile.from_json(recorded.to_json()) == recorded
    older = json.loads(job.to_json())
    del older["identity"]
    assert JobFile.from_json(json.dumps(older)).identity is None


def test_every_submission_has_its_own_id_and_names_its_task():
    identity = "e" * 64
    ids = {submission_id_for(OWNER, attempt, identity) for attempt in ("t01aaaaaaaa", "t01bbbbbbbb", "t02aaaaaaaa")}
    assert len(ids) == 3 and all(f"-{'e' * 32}-" in i for i in ids)
    meta = job_metadata(OWNER, "t01aaaaaaaa", identity)
    assert belongs_to(meta, RunOwner("d", "t", OWNER.run_id, try_number=5))
    assert not belongs_to(meta, RunOwner("d", "t", OWNER.run_id, try_number=1, map_index=0))
    # a job submitted before jobs carried the task key: matched by dag, task and run
    legacy = {"dag_id": "d", "task_id": "t", "run_id": OWNER.run_id, "try_number": "1"}
    assert belongs_to(legacy, OWNER) and not belongs_to({**legacy, "run_id": "other"}, OWNER)


# --- on the cluster -------------------------------------------------------------------------------------


def _start_try(tmp_path, run_id: str, try_number: int, die: str | None = None) -> subprocess.Popen:
    args = {
        "input": str(tmp_path / "input"),
        "out": str(tmp_path / "out"),
        "run_id": run_id,
        "try_number": try_number,
        "die": die,
    }
    log = open(tmp_path / f"try{try_number}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-c", TRY_SCRIPT, json.dumps(args)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _run_try(tmp_path, run_id: str, try_number: int, gate: Path | None = None):
    """The next try, in this process as a worker would run it (non-deferrable: it waits). ``gate``:
    opened once the try has its job (re-attached or submitted), so a gated job is still running
    when the try looks for it, and ends only then."""
    from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec
    from airflow_provider_batchinfer.links.ray_dashboard import XCOM_KEY

    op = BatchInferenceOperator(
        task_id="infer",
        model="gated_length",
        version="v1",
        input=str(tmp_path / "input"),
        output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
        job_spec=JobSpec(max_batch_rows=50),
        poll_interval=0.5,
    )
    ti = TaskInstanceStandIn(run_id=run_id, try_number=try_number)
    if gate is None:
        return op.execute({"ti": ti})
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = op.execute({"ti": ti})
        except BaseException as exc:  # re-raised below, in the test's thread
            outcome["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while XCOM_KEY not in ti.xcoms and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        gate.touch()
        worker.join(timeout=300)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _running_job(launcher, run_id: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> str:
    """The run's job once it is RUNNING, while the try in ``proc`` (its output in ``log``) waits on it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = jobs_of_run(launcher, run_id)
        if jobs and str(jobs[0].status.value if hasattr(jobs[0].status, "value") else jobs[0].status) == "RUNNING":
            return jobs[0].submission_id
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.3)
    raise AssertionError(f"no RUNNING job for {run_id}: {jobs_of_run(launcher, run_id)}")


def _wait_for_line(log: Path, line: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while line not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _rows_once(out: Path, rows: int) -> dict:
    manifest = committed_manifest(str(out))
    assert manifest is not None and manifest["counts"]["output_rows"] == rows
    table = pq.read_table([str(out / f["name"]) for f in manifest["files"]])
    ids = table.column("ticket_id").to_pylist()
    assert len(ids) == rows and len(set(ids)) == rows  # every row exactly once
    assert sorted(p.name for p in out.glob("part-*")) == sorted(f["name"] for f in manifest["files"])
    return manifest


@pytest.fixture
def gate(tmp_path):
    """The path that lets a gated job end; opened at the end whatever happened, so no job of the
    test is left holding the session cluster's CPUs."""
    path = tmp_path / "gate"
    yield path
    path.touch()


@pytest.mark.usefixtures("airflow_db")
def test_tries_lost_after_the_submit_or_killed_mid_job_reattach_to_the_one_running_job(
    ray_jobs_conn, launcher, gated_model, gate, tmp_path
):
    """Try 1 dies right after its submit; try 2 re-attaches to that job and is ``kill -9``-ed while it
    waits; try 3 re-attaches to the job, still running, and takes its result: one job, run once,
    fenced on the attempt of try 1's claim."""
    gated_tickets(tmp_path / "input", rows=200, files=2, gate=gate)  # the job runs until try 3 has it
    run_id = "manual__reattach"
    first = _start_try(tmp_path, run_id, 1, die="after_submit")
    assert first.wait(timeout=120) == 137, (tmp_path / "try1.log").read_text()[-3000:]
    claim = json.loads((tmp_path / "out" / "_job.json").read_text())  # recorded before the submit
    sid = claim["submission_id"]
    assert sid and len(claim["identity"]) == 64
    assert [j.submission_id for j in jobs_of_run(launcher, run_id)] == [sid]

    second = _start_try(tmp_path, run_id, 2)
    _wait_for_line(tmp_path / "try2.log", f"Re-attaching to job {sid}", second)
    assert _running_job(launcher, run_id, second, tmp_path / "try2.log") == sid
    second.kill()  # kill -9 of the task process: no on_kill, no clean-up
    second.wait(timeout=30)
    assert launcher.find(sid)["status"] == "RUNNING"  # the job lives on the cluster, not in the worker

    result = _run_try(tmp_path, run_id, 3, gate=gate)

    assert [j.submission_id for j in jobs_of_run(launcher, run_id)] == [sid]  # one job for the task, not two
    assert launcher.find(sid)["status"] == "SUCCEEDED"
    assert result["attempt"] == claim["attempt"] and result["attempt"].startswith("t01") and result["rows"] == 200
    manifest = _rows_once(tmp_path / "out", 200)
    assert manifest["job"]["attempt"] == claim["attempt"]
    # the run directory's claim was left as try 1 wrote it: the job fenced on that attempt
    assert json.loads((tmp_path / "out" / "_job.json").read_text()) == claim


@pytest.mark.usefixtures("airflow_db")
def test_a_changed_input_stops_the_old_job_and_starts_anew(ray_jobs_conn, launcher, gated_model, gate, tmp_path):
    gated_tickets(tmp_path / "input", rows=200, files=2, gate=gate)  # a job that runs until it is stopped
    run_id = "manual__changed_input"
    first = _start_try(tmp_path, run_id, 1)
    old_sid = _running_job(launcher, run_id, first, tmp_path / "try1.log")
    first.kill()
    first.wait(timeout=30)
    gated_tickets(tmp_path / "input", rows=100, files=2, gate=None)  # data_prep re-ran: a different input

    result = _run_try(tmp_path, run_id, 2)

    assert launcher.find(old_sid)["status"] == "STOPPED"
    (new,) = [j for j in jobs_of_run(launcher, run_id) if j.submission_id != old_sid]
    assert str(getattr(new.status, "value", new.status)) == "SUCCEEDED"
    assert result["attempt"].startswith("t02") and result["rows"] == 100
    manifest = _rows_once(tmp_path / "out", 100)
    assert manifest["job"]["attempt"] == result["attempt"]
    claim = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert claim["submission_id"] == new.submission_id and claim["identity"] == new.metadata["batchinfer_identity"]


@pytest.mark.usefixtures("airflow_db")
def test_a_worker_lost_before_its_submit_leaves_a_claim_the_next_try_submits_once(
    ray_jobs_conn, launcher, gated_model, tmp_path
):
    gated_tickets(tmp_path / "input", rows=100, files=2, gate=None)
    run_id = "manual__lost_before_submit"
    first = _start_try(tmp_path, run_id, 1, die="before_submit")
    assert first.wait(timeout=120) == 137, (tmp_path / "try1.log").read_text()[-3000:]
    claim = json.loads((tmp_path / "out" / "_job.json").read_text())  # recorded before the submit
    assert claim["submission_id"] and len(claim["identity"]) == 64
    assert jobs_of_run(launcher, run_id) == []  # the cluster never heard of it

    result = _run_try(tmp_path, run_id, 2)

    jobs = [j.submission_id for j in jobs_of_run(launcher, run_id)]
    assert len(jobs) == 1 and jobs[0] != claim["submission_id"]  # one fresh submission
    assert result["attempt"].startswith("t02") and result["rows"] == 100
    _rows_once(tmp_path / "out", 100)
