"""The fault-injection suite: bad inputs, faults mid-job, resume, fencing.

Each bad-input kind has its own test that feeds it and asserts a clear error naming what is wrong
and that nothing was committed (no ``_SUCCESS``), or, with ``on_error="dead_letter"``, a manifest
that reconciles (input rows = output rows + dead-lettered rows). Failures that happen before Ray
starts are tested on the runtime's own entrypoint (``runtime.driver.run``) with ``ray.init`` made to
fail, which also proves that no compute was requested. Job files and manifests are built with
``contract.JobFile`` / ``contract.Manifest``, as the operator and the runtime build them. Only what needs a running pipeline
(a model that raises, dead-lettering, killed workers, killed tasks, resume) starts jobs, on the
session's Ray cluster, driven through ``BatchInferenceOperator.execute`` as a task runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import (
    JOB_SPEC_FILE,
    SUCCESS_MARKER,
    Counts,
    FileEntry,
    JobRecord,
    Manifest,
    ModelRef,
)
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec, SaveMode, SpecError
from airflow_provider_batchinfer.runtime.errors import BadRowError, check_batch
from airflow_provider_batchinfer.store.commit.markers import validate_manifest
from airflow_provider_batchinfer.store.inputs import InputError
from airflow_provider_batchinfer.store.locations import StageError, resolve_location, sanitize_run_key
from airflow_provider_batchinfer.store.stage import Stage
from tests.models import PidLength, SlowLength, committed_manifest, job_file, write_job_file, write_tickets
from tests.task_context import TaskInstanceStandIn as _StandIn

from airflow.sdk.exceptions import AirflowException, AirflowFailException  # isort: skip

SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}


# --- shared set-up ------------------------------------------------------------------------------------


def TaskInstanceStandIn(**kwargs) -> _StandIn:
    """The fault suite's task identity: a scheduled run of ``bi_faults.infer``."""
    return _StandIn(**{"dag_id": "bi_faults", "run_id": "scheduled__2026-11-23T00:00:00+00:00", **kwargs})


def _operator(inputs, out, mode=SaveMode.ERROR, model="text_length", input_spec=None, **job):
    from airflow_provider_batchinfer import BatchInferenceOperator

    return BatchInferenceOperator(
        task_id="infer",
        model=model,
        version="v1",
        input=str(inputs),
        input_spec=input_spec or InputSpec(id_column="ticket_id"),
        output_spec=OutputSpec(stage_location=str(out), mode=mode),
        job_spec=JobSpec(**{"max_batch_rows": 50, "progress_interval_s": 1, **job}),
    )


def _write_spec(run_dir: Path, mv, registry_root: str, inputs: list[str], input_spec=None, job_spec=None) -> str:
    """A job file as the operator writes it, for driving the runtime's entrypoint directly."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_job_file(
        job_file(
            run_dir,
            mv,
            registry_root,
            inputs,
            job_id="batchinfer-faults",
            attempt="t01faults",
            input_spec=input_spec or InputSpec(id_column="ticket_id"),
            job_spec=job_spec,
        )
    )


@pytest.fixture
def no_ray(monkeypatch):
    """Make any attempt to start Ray fail loudly: these failures must come before any compute."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started, but this bad input must fail before any compute")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture
def fails_before_ray(no_ray, text_length_model, registry, tmp_path):
    """``check(inputs, match, **spec)``: the runtime fails with ``match`` before Ray, commits nothing."""
    from airflow_provider_batchinfer.runtime.driver import run

    def check(inputs, match, error=(InputError,), **kwargs):
        run_dir = tmp_path / "out"
        spec = _write_spec(run_dir, text_length_model, registry.root, [str(p) for p in inputs], **kwargs)
        with pytest.raises(error, match=match):
            run(spec)
        assert not (run_dir / SUCCESS_MARKER).exists()
        assert sorted(p.name for p in run_dir.iterdir() if p.name != "_claims") == [JOB_SPEC_FILE]  # no part, no marker

    return check


def _table(texts, ids=None):
    return pa.table(
        {
            "ticket_id": pa.array(ids if ids is not None else range(len(texts)), pa.int64()),
            "text": pa.array(texts, pa.string()),
        }
    )


# --- bad inputs that fail before Ray starts -----------------------------------------------------------


def test_bad_input_corrupt_parquet_file(fails_before_ray, tmp_path):
    good = write_tickets(tmp_path / "in", rows=20, files=1)
    (good / "tickets-99.parquet").write_bytes(b"PAR1 this is not a parquet footer")
    fails_before_ray([good], r"input file .*tickets-99.parquet is not a readable Parquet file")


def test_bad_input_empty_input(fails_before_ray, tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(_table([]), empty)
    fails_before_ray([empty], r"holds 0 rows; nothing to score")
    (tmp_path / "nothing").mkdir()
    fails_before_ray([tmp_path / "nothing"], r"holds no Parquet files")


def test_bad_input_missing_column(fails_before_ray, tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"ticket_id": [1, 2], "body": ["a", "b"]}), path)
    fails_before_ray(
        [path],
        r"model input 'text' needs column 'text', which the input .* does not have "
        r"\(columns: \['ticket_id', 'body'\]\).*column_mapping",
    )


def test_bad_input_wrong_dtype(fails_before_ray, tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"ticket_id": [1, 2], "text": [1.5, 2.5]}), path)
    fails_before_ray([path], r"column 'text' of .* is double, but model input 'text' expects string")


def test_bad_input_duplicate_ids(fails_before_ray, tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(_table(["a", "b", "c"], ids=[1, 7, 7]), path)
    fails_before_ray(
        [path],
        r"id column 'ticket_id' is not unique: 1 value\(s\) appear more than once "
        r"\(e.g. 7 appears 2 times\)",
    )


def test_bad_input_unreadable_file_reference(fails_before_ray, tmp_path):
    """An input reference that points at nothing readable (here a dangling symlink among the files)."""
    good = write_tickets(tmp_path / "in", rows=20, files=1)
    dangling = tmp_path / "gone.parquet"
    dangling.symlink_to(tmp_path / "deleted-by-data-prep.parquet")
    fails_before_ray([good / "tickets-00.parquet", dangling], r"input .*gone.parquet does not exist")


def test_bad_input_tampered_model_is_refused_by_the_runtime_and_by_every_replica(
    fails_before_ray, text_length_model, registry, tmp_path
):
    from airflow_provider_batchinfer.registry import TamperedModelError, verify_local_copy

    tickets = write_tickets(tmp_path / "in", rows=20, files=1)
    code = Path(text_length_model.uri) / "code" / "models.py"
    code.write_text(code.read_text() + "\n# injected\n")
    fails_before_ray([tickets], r"code/models.py does not match its recorded sha256", error=(TamperedModelError,))
    # the operator re-hashes first: the task fails before it writes anything
    out = tmp_path / "task-out"
    with pytest.raises(AirflowFailException, match=r"code/models.py does not match its recorded sha256"):
        _operator(tickets, out).execute({"ti": TaskInstanceStandIn()})
    assert not out.exists()
    # ModelReplica.__init__ runs this on every actor before loading: a copy changed on a worker's disk
    with pytest.raises(TamperedModelError, match="does not match its recorded sha256"):
        verify_local_copy(Path(text_length_model.uri), text_length_model.sha256)


# --- bad inputs refused by pure checks (no job) ------------------------------------------------------


def test_bad_input_nulls_and_nan():
    ids = ("ticket_id", pa.array([10, 11, 12]))
    with pytest.raises(
        BadRowError,
        match=r"column 'body' has 1 null value\(s\) in a batch of 3 rows "
        r"\(first at ticket_id=11\)",
    ):
        check_batch(pa.table({"text": ["a", None, "c"]}), ["body"], ids, None)
    with pytest.raises(BadRowError, match=r"column 'x' has 1 NaN value\(s\).*\(first at ticket_id=12\)"):
        check_batch(pa.table({"x": [1.0, 2.0, float("nan")]}), ["x"], ids, None)
    check_batch(pa.table({"text": ["a", "b", "c"], "x": [1.0, 2.0, 3.0]}), ["text", "x"], ids, None)  # clean


def test_bad_input_oversized_row():
    with pytest.raises(
        BadRowError,
        match=r"column 'text' has a value of 5,000 bytes, above "
        r"JobSpec.max_value_bytes=1,000 \(first at row 1 of the batch\)",
    ):
        check_batch(pa.table({"text": ["ok", "x" * 5000]}), ["text"], None, 1000)


def test_bad_input_non_utf8_text():
    texts = pa.array([b"fine", b"\xff\xfe latin-1?"], pa.binary()).view(pa.string())
    with pytest.raises(
        BadRowError,
        match=r"column 'text' holds text that is not valid UTF-8 in 1 row\(s\) "
        r"\(first at ticket_id=2\)",
    ):
        check_batch(pa.table({"text": texts}), ["text"], ("ticket_id", pa.array([1, 2])), None)


def test_bad_input_unknown_model_or_version(registry, text_length_model, tmp_path):
    from airflow_provider_batchinfer import BatchInferenceOperator
    from airflow_provider_batchinfer.registry import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match=r"'no_such_model'"):
        registry.get("no_such_model", "v1")
    op = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v7",
        input=str(tmp_path),
        output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
    )
    with pytest.raises(AirflowFailException, match=r"known versions of 'text_length': v1"):
        op.execute({"ti": TaskInstanceStandIn()})
    assert not (tmp_path / "out").exists()


def test_bad_input_path_traversal_in_run_key_params_or_manifest(tmp_path):
    for hostile in ("../../etc", "/etc/passwd", "..", "a/../../b"):
        key = sanitize_run_key(hostile)  # one path segment, never "." / "..", never absolute
        assert "/" not in key and not key.startswith(".")
        assert os.path.normpath(os.path.join(str(tmp_path), key)).startswith(str(tmp_path) + "/")
    param = "../../../etc"  # e.g. a templated stage_location="stage/{{ params.table }}"
    with pytest.raises(StageError, match="contains '..'"):
        resolve_location(f"stage/{param}", str(tmp_path))
    with pytest.raises(StageError, match="contains '..'"):
        resolve_location(f"s3://lake/stage/{param}", None)
    # a manifest naming a file outside its run directory is refused by every reader
    manifest = _manifest(tmp_path, [FileEntry("../other/part.parquet", size=1, rows=1, sha256="0" * 64)], "t01a")
    with pytest.raises(StageError, match="contains '..'"):
        validate_manifest(Stage.open(str(tmp_path)), manifest)


def test_bad_input_wrong_credentials(tmp_path):
    """A store that checks credentials (moto_server with IAM auth on, its own process on 127.0.0.1)
    refuses an unknown key: the task fails at once (permanent), naming bucket and key, and the
    secret never appears in the message."""
    from airflow_provider_batchinfer.store.s3 import S3StageError, check_bucket
    from tests.conftest import BackgroundServer, _free_port

    port = _free_port()
    moto = BackgroundServer(
        "moto-auth",
        [str(Path(os.sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        ports=[port],
        timeout=60,
        env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="1"),
    )
    try:
        import boto3

        # the one unauthenticated action creates the bucket; every later request must authenticate
        boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            region_name="us-east-1",
            aws_access_key_id="AKIDSETUP",
            aws_secret_access_key="unused",
        ).create_bucket(Bucket="lake")
        stage = Stage.open(
            "s3://lake/stage/run1",
            {
                "endpoint_url": f"http://127.0.0.1:{port}",
                "region": "us-east-1",
                "access_key": "AKIAWRONGKEY",
                "secret_key": "s3cr3t-value",
                "max_attempts": 1,
            },
        )
        with pytest.raises(
            S3StageError,
            match=r"bucket 'lake'.*(InvalidAccessKeyId|INVALID_ACCESS_KEY_ID|"
            r"AccessDenied|ACCESS_DENIED|Forbidden)",
        ) as info:
            check_bucket(stage.fs, stage.location)
            stage.child("part-00000-t01probe.parquet").write_bytes(b"PAR1")
        assert info.value.permanent, str(info.value)
        assert "s3cr3t-value" not in str(info.value)
    finally:
        moto.stop(timeout=30)


def test_bad_input_stage_location_does_not_exist(s3_server, tmp_path):
    from airflow_provider_batchinfer.store.s3 import S3StageError, check_bucket

    stage = Stage.open("s3://no-such-stage-bucket/out/run1", {"endpoint_url": s3_server, "region": "us-east-1"})
    with pytest.raises(S3StageError, match="S3 bucket 'no-such-stage-bucket' does not exist") as info:
        check_bucket(stage.fs, stage.location)
    assert info.value.permanent
    with pytest.raises(StageError, match="is relative but no stage root is configured"):
        resolve_location("out/run1", None)


def test_error_policy_specs_are_checked_when_the_dag_is_parsed():
    with pytest.raises(SpecError, match="on_error must be 'fail' or 'dead_letter'"):
        JobSpec(on_error="ignore")
    with pytest.raises(SpecError, match="max_error_fraction applies only with on_error='dead_letter'"):
        JobSpec(max_error_fraction=0.1)
    with pytest.raises(SpecError, match=r"max_error_fraction must be a fraction in \[0, 1\]"):
        JobSpec(on_error="dead_letter", max_error_fraction=2)
    assert JobSpec(on_error="dead_letter").error_fraction_limit == 0.01 and JobSpec().error_fraction_limit == 0
    with pytest.raises(SpecError, match="SaveMode.RESUME needs InputSpec\\(id_column="):
        _operator("in", "out", mode=SaveMode.RESUME, input_spec=InputSpec())


def test_pickle_flavors_are_not_loadable(registry, tmp_path):
    from airflow_provider_batchinfer.registry import RegistryError

    (tmp_path / "model.pkl").write_bytes(b"\x80\x04K\x01.")
    for flavor in ("pickle", "joblib"):
        with pytest.raises(RegistryError, match=f"unknown flavor '{flavor}'"):
            registry.log_model("pickled", "v1", flavor, str(tmp_path / "model.pkl"))
    # 15: sklearn takes a pickle only with an explicit trust_pickle=True (tests/e2e/test_flavors_tabular.py)
    with pytest.raises(RegistryError, match="is a pickle, and unpickling runs arbitrary code"):
        registry.log_model("pickled", "v1", "sklearn", str(tmp_path / "model.pkl"))
    assert registry.list_versions("pickled") == []


_MODEL = ModelRef(
    name="text_length",
    version="v1",
    flavor="python",
    sha256="0" * 64,
    uri="/registry/text_length/v1",
    signature=SIGNATURE,
)


def _manifest(run_dir: Path, files: list[FileEntry], attempt: str) -> Manifest:
    rows = sum(f.rows for f in files)
    return Manifest(
        run_dir=str(run_dir),
        files=tuple(files),
        counts=Counts(input_rows=rows, output_rows=rows),
        model=_MODEL.without_signature(),
        job=JobRecord(id="batchinfer-faults", attempt=attempt),
        input_locations=("in",),
        input_files=("in/a.parquet",),
    )


def test_a_zombie_attempts_late_commit_is_refused(tmp_path):
    """Attempt t01 was presumed dead and t02 took over (its _job.json, even its _SUCCESS); when t01
    wakes up and tries to commit, it is fenced off and t02's result stays as it was."""
    import hashlib

    from airflow_provider_batchinfer.store.commit.rundir import FencedError, commit

    run_dir = tmp_path / "out"
    run_dir.mkdir()
    part = run_dir / "part-00000-t01zombie.parquet"
    pq.write_table(_table(["a"]), part)
    newer_job = job_file(
        run_dir,
        _MODEL,
        "/registry",
        ["in"],
        attempt="t02newer",
        try_number=2,
        input_spec=InputSpec(id_column="ticket_id"),
        resume=True,
    )
    write_job_file(newer_job)
    newer = _manifest(run_dir, [], "t02newer").to_json()
    (run_dir / SUCCESS_MARKER).write_text(newer)
    late = _manifest(
        run_dir,
        [FileEntry(part.name, size=part.stat().st_size, rows=1, sha256=hashlib.sha256(part.read_bytes()).hexdigest())],
        "t01zombie",
    )
    with pytest.raises(
        FencedError,
        match=r"attempt t01zombie is no longer the owner .* attempt t02newer \(try 2\) "
        r"took over; not committing",
    ):
        commit(Stage.open(str(run_dir)), late)
    assert (run_dir / SUCCESS_MARKER).read_text() == newer
    # nor can a zombie that starts late with RESUME clean up (delete) parts in the newer attempt's directory
    from airflow_provider_batchinfer.runtime.rows.resume import resume_state

    (run_dir / "part-00001-t02newer.parquet").write_bytes(b"PAR1 being written")
    zombie = job_file(
        run_dir,
        _MODEL,
        "/registry",
        ["in"],
        attempt="t01zombie",
        resume=True,
        input_spec=InputSpec(id_column="ticket_id"),
    )
    with pytest.raises(FencedError, match="attempt t01zombie does not own"):
        resume_state(zombie, Stage.open(str(run_dir)))
    assert (run_dir / "part-00001-t02newer.parquet").exists()


# --- jobs: model errors, dead letters ---------------------------------------------------------------


def pytest_jobs(test):
    """A test that runs jobs on the session's Ray cluster."""
    return pytest.mark.usefixtures("airflow_db", "ray_cluster")(test)


def _bad_rows_input(directory: Path) -> Path:
    """200 tickets in 2 files with four bad rows: the model raises on 17, 50 is null, 90 is
    oversized (above max_value_bytes=1000), 130 is not UTF-8."""
    directory.mkdir(parents=True)
    texts: list = [f"ticket {i}" for i in range(200)]
    texts[17], texts[50], texts[90] = "boom", None, "y" * 2000
    raw = [None if t is None else t.encode() for t in texts]
    raw[130] = b"\xff\xfe not utf-8"
    table = pa.table(
        {"ticket_id": pa.array(range(200), pa.int64()), "text": pa.array(raw, pa.binary()).view(pa.string())}
    )
    pq.write_table(table.slice(0, 100), directory / "a.parquet")
    pq.write_table(table.slice(100), directory / "b.parquet")
    return directory


@pytest.mark.usefixtures("airflow_db")
def test_bad_input_row_that_makes_the_model_raise_fails_the_job_by_default(
    batchinfer_home, text_length_model, tmp_path
):
    bad = write_tickets(tmp_path / "bad", rows=200, files=2, bad_row=123)
    out = tmp_path / "out"
    with pytest.raises(AirflowException, match=r"ValueError: cannot score text 'boom'"):
        _operator(bad, out).execute({"ti": TaskInstanceStandIn()})
    assert not (out / SUCCESS_MARKER).exists()
    assert not (out / "_errors").exists()


@pytest_jobs
def test_dead_letter_isolates_bad_rows_and_the_manifest_reconciles(batchinfer_home, text_length_model, tmp_path):
    inputs = _bad_rows_input(tmp_path / "in")
    out = tmp_path / "out"
    xcom = _operator(inputs, out, on_error="dead_letter", max_error_fraction=0.05, max_value_bytes=1000).execute(
        {"ti": TaskInstanceStandIn()}
    )
    manifest = committed_manifest(str(out))
    assert manifest["counts"] == {"input_rows": 200, "output_rows": 196, "error_rows": 4}
    assert (
        xcom["error_rows"] == 4 and xcom["error_files"] and all(f.startswith("_errors/") for f in xcom["error_files"])
    )
    errors = pq.read_table([str(out / f["name"]) for f in manifest["error_files"]]).sort_by("ticket_id").to_pylist()
    assert [e["ticket_id"] for e in errors] == [17, 50, 90, 130]
    assert "cannot score text 'boom'" in errors[0]["error"]
    assert "null value" in errors[1]["error"]
    assert "above JobSpec.max_value_bytes=1,000" in errors[2]["error"]
    assert "not valid UTF-8" in errors[3]["error"]
    scored = pq.read_table([str(out / f["name"]) for f in manifest["files"]])
    assert scored.column_names == ["ticket_id", "length"]
    assert sorted(scored.column("ticket_id").to_pylist()) == sorted(set(range(200)) - {17, 50, 90, 130})

    # every listed file carries the sha256 of its bytes, computed while it was written
    import hashlib

    for entry in manifest["files"] + manifest["error_files"]:
        assert entry["sha256"] == hashlib.sha256((out / entry["name"]).read_bytes()).hexdigest()

    # the same dead letters over a 1% limit: the driver refuses to commit (check_error_fraction runs
    # while the manifest is built, before rundir.commit), quoting the first errors
    from airflow_provider_batchinfer.runtime.errors import JobError
    from airflow_provider_batchinfer.runtime.output.commit import check_error_fraction

    (out / SUCCESS_MARKER).unlink()
    strict = JobSpec(on_error="dead_letter", max_error_fraction=0.01)
    error_names = [f["name"] for f in manifest["error_files"]]
    with pytest.raises(
        JobError,
        match=r"4 of 200 rows \(2.00%\) could not be scored, above "
        r"JobSpec.max_error_fraction=0.01; not committing. First errors: .*",
    ):
        check_error_fraction(4, 200, strict, Stage.open(str(out)), error_names)
    check_error_fraction(2, 200, strict, Stage.open(str(out)), error_names)  # 1%: allowed


def _replica(registry, model, policy):
    from airflow_provider_batchinfer.runtime.model.replica import ModelReplica
    from airflow_provider_batchinfer.runtime.planning.pipeline import plan_columns, with_id_column

    schema = pa.schema([("ticket_id", pa.int64()), ("text", pa.string())])
    plan = with_id_column(plan_columns(schema, SIGNATURE, InputSpec(), "in.parquet"), policy.get("id_column"))
    return ModelReplica(
        str(registry.local_copy(model.name, model.version)), model.sha256, plan, {}, "cpu", 1, policy=policy
    )


def test_a_model_that_raises_names_its_error_the_batch_and_the_dead_letter_option(registry, text_length_model):
    """``on_error="fail"``: the model's own error, the batch's id range (or its row range without an
    id column), and the way to isolate the failing rows instead."""
    from airflow_provider_batchinfer.runtime.errors import ModelBatchError

    batch = _table(["fine", "boom", "also fine"], ids=[40, 41, 42])
    replica = _replica(registry, text_length_model, {"on_error": "fail", "id_column": "ticket_id"})
    with pytest.raises(
        ModelBatchError,
        match=r"^ValueError: cannot score text 'boom' "
        r"\(row 1 of the batch\), raised by model text_length/v1 on the batch of 3 row\(s\) with ticket_id "
        r"40\.\.42; nothing was committed\..*"
        r'JobSpec\(on_error="dead_letter"\) to isolate the failing rows',
    ):
        replica(batch)
    anonymous = _replica(registry, text_length_model, {"on_error": "fail"})
    with pytest.raises(
        ModelBatchError,
        match=r"^ValueError: cannot score text 'boom' .* on a batch of 3 row\(s\) "
        r"\(rows 0\.\.2 of the batch; set InputSpec\(id_column=\.\.\.\)",
    ):
        anonymous(batch)
    # bad input rows keep their own message (the column and the row), not the model's
    with pytest.raises(BadRowError, match=r"column 'text' has 1 null value"):
        replica(pa.table({"ticket_id": [1, 2], "text": ["a", None]}))
    # with dead_letter the same batch scores: the failing row comes back marked, with the model's message
    from airflow_provider_batchinfer.runtime.errors import split_errors

    good, bad = split_errors(
        _replica(
            registry,
            text_length_model,
            {"on_error": "dead_letter", "id_column": "ticket_id", "keep_columns": ["ticket_id"]},
        )(batch),
        ["ticket_id"],
    )
    assert good.column("ticket_id").to_pylist() == [40, 42]
    assert bad.to_pylist() == [{"ticket_id": 41, "error": "ValueError: cannot score text 'boom' (row 0 of the batch)"}]


@pytest.mark.usefixtures("ray_cluster")
def test_a_model_that_raises_fails_the_runtime_naming_the_batch_ids_and_commits_nothing(
    registry, text_length_model, tmp_path
):
    """The same message through a real Ray job: the runtime's last line is a JobFailure naming the
    model's error and the failing batch's ids, and the run directory holds no marker."""
    import subprocess
    import sys

    from airflow_provider_batchinfer.contract import JobFailure, last_failure

    bad = write_tickets(tmp_path / "in", rows=120, files=1, bad_row=75)
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    spec = _write_spec(run_dir, text_length_model, registry.root, [str(bad)], job_spec=JobSpec(max_batch_rows=50))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", spec],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    failure = last_failure(proc.stdout)
    assert proc.returncode != 0 and isinstance(failure, JobFailure), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert failure.type != "JobFailure" and not failure.permanent
    assert re.search(
        r"^ValueError: cannot score text 'boom' .*, raised by model text_length/v1 on .* with ticket_id "
        r"(\d+)\.\.(\d+); .*JobSpec\(on_error=\"dead_letter\"\)",
        failure.error,
    ), proc.stdout[-6000:]
    low, high = map(int, re.search(r"ticket_id (\d+)\.\.(\d+)", failure.error).groups())
    assert low <= 75 <= high and high - low < 50
    assert not (run_dir / SUCCESS_MARKER).exists()
    assert not (run_dir / "_errors").exists()


# --- jobs: killed workers and tasks, resume ----------------------------------------------------------


@pytest.fixture
def pid_model(registry):
    return registry.log_model("pid_length", "v1", "python", python_class=PidLength, signature=SIGNATURE)


@pytest.fixture
def slow_model(registry):
    return registry.log_model("slow_length", "v1", "python", python_class=SlowLength, signature=SIGNATURE)


def _ids(out: Path, manifest: dict) -> list[int]:
    return sorted(pq.read_table([str(out / f["name"]) for f in manifest["files"]]).column("ticket_id").to_pylist())


@pytest_jobs
def test_a_ray_worker_killed_mid_job_is_replaced_and_counts_stay_exact(batchinfer_home, pid_model, tmp_path):
    inputs = write_tickets(tmp_path / "in", rows=300, files=6)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    killed: list[int] = []

    def kill_first_worker():
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            pids = [int(p.name) for p in pid_dir.iterdir()]
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.1)

    killer = threading.Thread(target=kill_first_worker, daemon=True)
    killer.start()
    op = _operator(
        inputs,
        tmp_path / "out",
        model="pid_length",
        input_spec=InputSpec(id_column="ticket_id", params={"pid_dir": str(pid_dir), "delay": 0.3}),
    )
    xcom = op.execute({"ti": TaskInstanceStandIn()})
    killer.join(timeout=5)
    assert killed, "the test never saw a worker to kill"
    workers = {int(p.name) for p in pid_dir.iterdir()}
    assert workers - set(killed), "no new worker took over after the kill"
    manifest = committed_manifest(str(tmp_path / "out"))
    assert xcom["rows"] == 300 and manifest["counts"] == {"input_rows": 300, "output_rows": 300, "error_rows": 0}
    assert _ids(tmp_path / "out", manifest) == list(range(300))  # exactly once: no loss, no duplicate


def _complete_parts(out: Path) -> list[Path]:
    done = []
    for part in sorted(out.glob("part-*.parquet")):
        try:
            pq.read_metadata(part)
            done.append(part)
        except Exception:
            pass
    return done


def _settled(out: Path, quiet_s: float = 2.0, timeout: float = 30) -> None:
    """Wait until no part changes for ``quiet_s``: the killed driver's Ray workers are gone."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = sorted((p.name, p.stat().st_size) for p in out.glob("part-*.parquet"))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


@pytest_jobs
def test_task_killed_mid_job_then_retried_with_overwrite_and_with_resume(
    batchinfer_home, slow_model, tmp_path, monkeypatch
):
    rows = 240
    inputs = write_tickets(tmp_path / "in", rows=rows, files=6)
    out = tmp_path / "out"
    spec = InputSpec(id_column="ticket_id")
    first = _operator(
        inputs, out, mode=SaveMode.RESUME, model="slow_length", input_spec=spec, max_batch_rows=40, rows_per_part=40
    )
    failure: list[BaseException] = []

    def run_first():
        try:
            first.execute({"ti": TaskInstanceStandIn(try_number=1)})
        except BaseException as exc:  # the killed job fails the try
            failure.append(exc)

    task = threading.Thread(target=run_first)
    task.start()
    deadline = time.monotonic() + 180
    while len(_complete_parts(out)) < 2 and time.monotonic() < deadline and task.is_alive():
        time.sleep(0.1)
    proc = first._launcher._proc if first._launcher is not None else None
    assert proc is not None, f"the first try ended before it could be killed: {failure}"
    os.killpg(proc.pid, signal.SIGKILL)  # the task's job dies with no chance to clean up
    task.join(timeout=60)
    assert failure and not (out / SUCCESS_MARKER).exists()
    _settled(out)
    kept = _complete_parts(out)
    assert 2 <= len(kept) < 6
    # a part cut off mid-write (what a kill during a write leaves): no footer
    whole = kept[0].read_bytes()
    (out / "part-00099-t01cutoff.parquet").write_bytes(whole[: len(whole) // 2])
    overwrite_dir = tmp_path / "out-overwrite"
    shutil.copytree(out, overwrite_dir)

    # retry with RESUME: the complete parts stay, only the remaining rows are scored
    resumed = _operator(
        inputs, out, mode=SaveMode.RESUME, model="slow_length", input_spec=spec, max_batch_rows=40, rows_per_part=40
    )
    xcom = resumed.execute({"ti": TaskInstanceStandIn(try_number=2)})
    manifest = committed_manifest(str(out))
    kept_rows = sum(pq.read_metadata(p).num_rows for p in kept)
    assert manifest["resume"]["kept_rows"] == kept_rows > 0
    assert manifest["resume"]["processed_rows"] == rows - kept_rows  # only the remaining rows were scored
    assert manifest["resume"]["removed_files"] == ["part-00099-t01cutoff.parquet"]
    assert not (out / "part-00099-t01cutoff.parquet").exists()
    assert {p.name for p in kept} <= {f["name"] for f in manifest["files"]}
    assert xcom["rows"] == rows and manifest["counts"] == {"input_rows": rows, "output_rows": rows, "error_rows": 0}
    assert _ids(out, manifest) == list(range(rows))  # exactly once

    # retry with OVERWRITE (on a copy of the same leftovers): one clean result of the new attempt only.
    # The operator clears the leftovers before the launch, whatever scores the rows: this retry runs
    # on the embedded default, scored in its runtime's own process (no Ray workers to start), with no
    # spare runtime process started after it
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("BATCHINFER_WARM_RUNTIME", "0")
    clean = _operator(
        inputs,
        overwrite_dir,
        mode=SaveMode.OVERWRITE,
        model="slow_length",
        input_spec=spec,
        max_batch_rows=40,
        rows_per_part=120,
    )
    xcom = clean.execute({"ti": TaskInstanceStandIn(try_number=2)})
    manifest = committed_manifest(str(overwrite_dir))
    assert manifest["job"]["pool"]["in_driver"]
    assert manifest["resume"]["processed_rows"] == rows and manifest["resume"]["kept_rows"] == 0
    assert sorted(p.name for p in overwrite_dir.glob("part-*.parquet")) == sorted(f["name"] for f in manifest["files"])
    assert all(xcom["attempt"] in f["name"] for f in manifest["files"])
    assert _ids(overwrite_dir, manifest) == list(range(rows))


def test_resume_refuses_parts_that_repeat_rows_and_recounts_them(tmp_path):
    """Two complete parts holding the same row (a retried write under another attempt id) must not
    both be listed: the older attempt's (in the claim's order) is dropped and its rows are scored again."""
    from airflow_provider_batchinfer.runtime.rows.done_set import DoneSet
    from airflow_provider_batchinfer.runtime.rows.resume import collect_committed

    pq.write_table(_table(["a", "b"], ids=[1, 2]), tmp_path / "part-00000-t01a.parquet")
    pq.write_table(_table(["b", "c"], ids=[2, 3]), tmp_path / "part-00001-t02b.parquet")
    (tmp_path / "_errors").mkdir()
    pq.write_table(
        pa.table({"ticket_id": [9], "error": ["ValueError: x"]}), tmp_path / "_errors" / "part-00000-t01a.parquet"
    )
    kept = collect_committed(Stage.open(str(tmp_path)), "ticket_id", attempts=("t01a", "t02b"))
    assert [f.name for f in kept["files"]] == ["part-00001-t02b.parquet"]
    assert kept["error_rows"] == 1 and kept["removed"] == ["part-00000-t01a.parquet"]
    source = tmp_path / "input" / "in.parquet"
    source.parent.mkdir()
    pq.write_table(_table(list("wxyz"), ids=[1, 2, 3, 9]), source)
    with DoneSet() as done:  # only the rows of the parts kept are done: id 1 is scored again
        collect_committed(Stage.open(str(tmp_path)), "ticket_id", done, attempts=("t01a", "t02b"))
        assert done.match([str(source)], "ticket_id", None, 4) == {0: 3}
        assert [r for _, rows in done.done_rows([0]) for r in rows.tolist()] == [1, 2, 3]


# --- file columns (InputSpec.column_handling): traversal and unreadable references, per row --------------


def test_bad_input_file_column_traversal_and_unreadable_reference_fail_or_dead_letter_per_row(
    registry, text_length_model, tmp_path, monkeypatch
):
    """A file column holding a path that escapes the allowed roots (``..``, elsewhere) or a file that
    cannot be read: by default the batch fails naming the row's path; with ``dead_letter`` only those
    rows go to ``_errors/`` with that message. An escaping file is never opened, even when it exists."""
    from airflow_provider_batchinfer.runtime.errors import split_errors
    from airflow_provider_batchinfer.runtime.model import dereference
    from airflow_provider_batchinfer.runtime.model.dereference import FileReferenceError
    from airflow_provider_batchinfer.runtime.model.replica import ModelReplica
    from airflow_provider_batchinfer.runtime.planning.pipeline import plan_columns

    root = tmp_path / "stage"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "ok.txt").write_text("fine")
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    paths = [
        str(root / "docs" / "ok.txt"),
        str(root / "docs" / ".." / ".." / "secret.txt"),
        str(secret),
        str(root / "docs" / "missing.txt"),
        str(root / "docs"),
    ]
    batch = pa.table({"id": list(range(len(paths))), "path": paths})
    spec = InputSpec(column_mapping={"path": "text"}, column_handling={"path": "base64"}, id_column="id")
    plan = plan_columns(batch.schema, SIGNATURE, spec, "in.parquet")
    plan["dereference"] = dereference.dereference_plan(
        spec.column_handling, plan["sources"], plan["model_inputs"], SIGNATURE["inputs"], [str(root)], None
    )
    opened: list[str] = []
    real_read = dereference._read
    monkeypatch.setattr(dereference, "_read", lambda loc, so: opened.append(loc) or real_read(loc, so))
    model_dir = str(registry.local_copy("text_length", "v1"))

    fail = ModelReplica(
        model_dir,
        text_length_model.sha256,
        plan,
        {},
        "cpu",
        1,
        policy={"on_error": "fail", "keep_columns": ["id"], "id_column": "id"},
    )
    with pytest.raises(
        FileReferenceError,
        match=r"column 'text': '.*/\.\./secret.txt' contains '\.\.'; file locations may not climb out",
    ):
        fail(batch)

    dead = ModelReplica(
        model_dir,
        text_length_model.sha256,
        plan,
        {},
        "cpu",
        1,
        policy={"on_error": "dead_letter", "keep_columns": ["id"], "id_column": "id"},
    )
    good, bad = split_errors(dead(batch), ["id"])
    assert good.column("id").to_pylist() == [0]
    assert good.column("length").to_pylist() == [len("ZmluZQ==")]  # base64 of "fine"
    errors = dict(zip(bad.column("id").to_pylist(), bad.column("error").to_pylist(), strict=False))
    assert sorted(errors) == [1, 2, 3, 4]
    assert "contains '..'" in errors[1] and "outside the allowed roots" in errors[2]
    assert "missing.txt" in errors[3] and "does not exist" in errors[3]
    assert str(root / "docs") in errors[4]
    assert str(secret) not in opened and not any("secret" in o for o in opened)
