"""The S3 claim and commit check their store and their withdrawals, and a reader checks the claim a
marker was committed under.

Every request of the attempt under test goes through ``tests/s3_proxy.py`` in front of the S3 server:
forwarded as it is (moto honours S3's conditional requests), with its conditional headers stripped
(a store that ignores them), its conditional requests answered with an error (a store that says it
does not support them), or answered with an error (a withdrawal the store refuses). Setting up and
inspecting goes to the S3 server directly, around the proxy.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, Manifest, ManifestError
from airflow_provider_batchinfer.contract.specs import SaveMode
from airflow_provider_batchinfer.contract.tables import TableOutput
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.commit.claims import claims_for
from airflow_provider_batchinfer.store.commit.verdicts import Verdicts
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.locations import StageError
from airflow_provider_batchinfer.store.stage import Stage
from tests.component.test_commit_race import NEWER_OWNER, contents, write_attempt
from tests.runs import OWNER, job_file
from tests.s3_proxy import FaultProxy
from tests.task_context import TaskInstanceStandIn

KEY_ID, SECRET = "AKIDCONDTEST", "cond-secret"
PROBE_DIR = "_probe"  # where the probe puts its objects in a run directory (fence.PROBE_DIR)
NAMES = ("If-None-Match on PutObject", "If-Match on PutObject", "If-Match on DeleteObject")
#: what each kind of store does with a conditional PUT or DELETE, as a proxy rule, and how the
#: refusal names what it answered
STORES = {
    "strip": ({"match": "^(PUT|DELETE) ", "action": "strip"}, "applied as a plain request"),
    "501": (
        {"match": "^(PUT|DELETE) ", "conditional": True, "status": 501, "code": "NotImplemented"},
        "answered 501 NotImplemented",
    ),
    "400": (
        {
            "match": "^(PUT|DELETE) ",
            "conditional": True,
            "status": 400,
            "code": "InvalidArgument",
            "message": "Unsupported header If-None-Match or If-Match",
        },
        "answered 400 InvalidArgument",
    ),
}


SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}


def lacking(how: str) -> str:
    """The refusal's account of the store: each condition and how it was answered."""
    return "; ".join(f"{name} ({how})" for name in NAMES)


def options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "region": "us-east-1", "access_key": KEY_ID, "secret_key": SECRET}


@pytest.fixture
def proxy(s3_server, tmp_path):
    fault_proxy = FaultProxy(s3_server, tmp_path / "proxy.log")
    yield fault_proxy
    fault_proxy.stop()


@pytest.fixture
def run(s3_server, s3_bucket) -> Stage:
    """A run directory on the S3 server, opened around the proxy."""
    return Stage.open(f"s3://{s3_bucket}/out/run1", options(s3_server))


def through(proxy: FaultProxy, stage: Stage) -> Stage:
    """``stage`` as the attempt under test opens it: through the proxy."""
    return Stage.open(stage.location, {**options(proxy.endpoint), "max_attempts": 1})


def probes(proxy: FaultProxy, since: int = 0) -> list[tuple[str, int | None]]:
    return [(r["method"], r["status"]) for r in proxy.requests(since) if f"/{PROBE_DIR}/" in r["target"]]


# --- the store is asked before the first marker -----------------------------------------------------------


def test_a_store_that_ignores_conditional_writes_is_refused_and_nothing_is_committed(run, proxy, s3_bucket):
    from airflow_provider_batchinfer.runtime.reporting import is_permanent

    manifest = write_attempt(run, "t01aaaa", [1, 2, 3, 4])
    proxy.start({"match": "^(PUT|DELETE) ", "action": "strip"})
    before = contents(run)
    with pytest.raises(StageError, match="not committing") as info:
        rundir.commit(through(proxy, run), manifest)
    message = str(info.value)
    store = f"bucket '{s3_bucket}' on the S3-compatible store at {proxy.endpoint}"
    assert f"{store} does not honour the conditional requests the commit relies on ({lacking(STORES['strip'][1])})" in (
        message
    )
    assert "honours S3 conditional writes" in message
    assert type(info.value).__name__ == "ConditionalWritesUnsupported" and is_permanent(info.value)
    assert contents(run) == before and SUCCESS_MARKER not in before  # no marker, no probe left, parts kept
    assert any(r["injected"] == "strip" for r in proxy.requests())
    assert read_valid_manifest(run.location, options(proxy.endpoint)) is None


def test_a_store_that_honours_them_is_asked_once_per_process_and_the_probe_is_removed(run, proxy, s3_server, s3_bucket):
    proxy.start()
    first = write_attempt(run, "t01aaaa", [1, 2])
    rundir.commit(through(proxy, run), first)
    # created, then refused three times (412), then removed; asked again on a fresh key only after a "no"
    assert probes(proxy) == [("PUT", 200), ("PUT", 412), ("PUT", 412), ("DELETE", 412), ("DELETE", 204)]
    assert not [name for name, _ in run.list_files() if name.startswith(PROBE_DIR)]
    seen = len(proxy.requests())
    other = Stage.open(f"s3://{s3_bucket}/out/run2", options(s3_server))
    rundir.commit(through(proxy, other), write_attempt(other, "t01bbbb", [3]))
    assert probes(proxy, seen) == []  # the same endpoint and bucket: known
    assert read_valid_manifest(other.location, options(proxy.endpoint)).job.attempt == "t01bbbb"


@pytest.mark.parametrize("kind", ["501", "400"])
def test_a_store_that_rejects_conditional_writes_is_refused_like_one_that_ignores_them(run, proxy, s3_bucket, kind):
    """Its error answers to the conditional headers are the probe's "does not honour", not an S3
    error of the commit's own."""
    from airflow_provider_batchinfer.runtime.reporting import is_permanent

    rule, how = STORES[kind]
    manifest = write_attempt(run, "t01aaaa", [1, 2, 3])
    proxy.start(rule)
    before = contents(run)
    with pytest.raises(StageError, match="not committing") as info:
        rundir.commit(through(proxy, run), manifest)
    assert type(info.value).__name__ == "ConditionalWritesUnsupported" and is_permanent(info.value)
    assert f"at {proxy.endpoint} does not honour the conditional requests the commit relies on ({lacking(how)})" in (
        str(info.value)
    )
    assert contents(run) == before and SUCCESS_MARKER not in before
    assert any(r["injected"] == rule["code"] for r in proxy.requests())


def test_another_invalid_argument_stays_the_stores_own_error(run, proxy, s3_bucket):
    """A 400 InvalidArgument that names no conditional header says nothing about conditions: the
    claim fails with the store's own error (naming bucket and key), and nothing is written."""
    proxy.start({"match": "^PUT ", "conditional": True, "status": 400, "code": "InvalidArgument"})
    with pytest.raises(
        StageError, match=rf"S3 conditional write failed for bucket '{s3_bucket}'.*InvalidArgument"
    ) as info:
        rundir.claim(through(proxy, run), job_file(run.location, attempt="t01aaaa"))
    assert type(info.value).__name__ == "S3StageError"
    assert contents(run) == {}


# --- the claim asks first: no job starts on a store that cannot fence its commit ------------------------------


@pytest.mark.parametrize("kind", sorted(STORES))
def test_a_claim_on_a_store_without_conditional_writes_is_refused_before_anything_is_written(
    run, proxy, s3_bucket, kind
):
    from airflow_provider_batchinfer.runtime.reporting import is_permanent

    rule, how = STORES[kind]
    proxy.start(rule)
    attempt = through(proxy, run)
    rundir.prepare(attempt, OWNER, SaveMode.OVERWRITE, result={}, materialized_input=False)
    with pytest.raises(
        StageError, match=f"not claiming {run.location} for attempt t01aaaa; no job was started"
    ) as info:
        rundir.claim(attempt, job_file(run.location, attempt="t01aaaa"))
    assert type(info.value).__name__ == "ConditionalWritesUnsupported" and is_permanent(info.value)
    store = f"bucket '{s3_bucket}' on the S3-compatible store at {proxy.endpoint}"
    assert f"{store} does not honour the conditional requests the commit relies on ({lacking(how)})" in (
        str(info.value)
    )
    assert contents(run) == {}  # no claim, no part, no probe object left
    written = [r["target"] for r in proxy.requests() if r["method"] == "PUT"]
    assert written and all(f"/{PROBE_DIR}/t01aaaa-" in target for target in written)  # the probe's only


def test_a_claim_asks_the_store_and_its_commit_finds_the_answer_kept(run, proxy):
    proxy.start()
    manifest = write_attempt(through(proxy, run), "t01aaaa", [1, 2])  # the claim, then the parts
    assert probes(proxy) == [("PUT", 200), ("PUT", 412), ("PUT", 412), ("DELETE", 412), ("DELETE", 204)]
    seen = len(proxy.requests())
    rundir.commit(through(proxy, run), manifest)
    assert probes(proxy, seen) == []
    assert read_valid_manifest(run.location, options(proxy.endpoint)).job.attempt == "t01aaaa"


def test_a_table_claim_directory_is_claimed_without_asking(run, proxy):
    """An Iceberg run's claim directory gets no marker (its rows commit as a snapshot, fenced through
    the catalog), so a store without conditional writes may hold it."""
    proxy.start(STORES["strip"][0])
    table = TableOutput("db.scores", {"name": "cat"}, "run1", "overwrite", run.location, "s3://elsewhere/scores")
    job = dataclasses.replace(job_file("s3://elsewhere/scores/data/run1/t01aaaa"), table_output=table)
    rundir.claim(through(proxy, run), job)
    assert probes(proxy) == []
    assert rundir.read_claim(run) == job


@pytest.mark.parametrize("kind", ["strip", "501"])
def test_the_operator_fails_the_task_without_retries_before_the_job_starts(
    proxy, s3_server, s3_bucket, monkeypatch, tmp_path, kind
):
    """Through ``BatchInferenceOperator.execute``, as a task's try runs it: the task fails without
    Airflow retries, naming the store and what it lacks, and the run directory is left without a
    claim or a part: no job was launched."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec

    root = s3_task_setup(proxy, s3_server, s3_bucket, monkeypatch, tmp_path)
    out = Stage.open(f"{root}/out/run1", options(s3_server))
    rule, how = STORES[kind]
    proxy.start(rule)
    task = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=f"{root}/input",
        output_spec=OutputSpec(stage_location=out.location),
    )
    with pytest.raises(
        AirflowFailException, match=f"not preparing {out.location}; nothing in it was changed and no job was started"
    ) as info:
        task.execute({"ti": TaskInstanceStandIn(try_number=1)})
    assert f"at {proxy.endpoint} does not honour the conditional requests the commit relies on ({lacking(how)})" in (
        str(info.value)
    )
    assert contents(out) == {}  # no _job.json, no part, no probe object
    written = {r["target"].split("?")[0] for r in proxy.requests() if r["method"] == "PUT"}
    assert written and all(f"/{s3_bucket}/out/run1/{PROBE_DIR}/" in target for target in written)


# --- a withdrawal is never swallowed ------------------------------------------------------------------------


def test_a_withdrawal_the_store_refuses_fails_the_attempt_loudly(run, proxy, s3_bucket):
    """A zombie wrote its marker as a newer try claimed the run; deleting it is refused (403): the
    attempt fails saying so, and readers refuse the marker it could not withdraw."""
    late = write_attempt(run, "t01zombie", [1, 2, 3])
    zombie = rundir.hold(run, "t01zombie")
    write_attempt(run, "t02newer", [4, 5], owner=NEWER_OWNER)
    proxy.start({"match": f"^DELETE /{s3_bucket}/out/run1/{SUCCESS_MARKER}", "status": 403, "code": "AccessDenied"})
    with pytest.raises(StageError, match="could not be withdrawn") as info:
        claims_for(through(proxy, run)).write_marker(zombie, late.to_json().encode())
    message = str(info.value)
    assert type(info.value).__name__ == "WithdrawalFailed"
    assert f"{run.location}/{SUCCESS_MARKER}" in message and "AccessDenied" in message
    assert Manifest.from_json(run.child(SUCCESS_MARKER).read_bytes()).job.attempt == "t01zombie"  # it is there
    with pytest.raises(
        ManifestError, match="committed by attempt t01zombie, but the run directory is claimed by attempt t02newer"
    ):
        read_valid_manifest(run.location, options(proxy.endpoint))


def test_a_marker_the_owner_replaced_counts_as_withdrawn(run, proxy):
    """The one refusal that is not a failure: the key no longer holds the zombie's version (the
    claim's holder replaced it), so the zombie is fenced and the holder's marker stays."""
    late = write_attempt(run, "t01zombie", [1, 2])
    zombie = rundir.hold(run, "t01zombie")
    newer = write_attempt(run, "t02newer", [3, 4], owner=NEWER_OWNER)
    store = claims_for(through(proxy.start(), run))
    etag = store._put(zombie, late.to_json().encode())  # the zombie's write, then the holder's commit
    rundir.commit(run, newer)
    store._withdraw(etag)
    assert Manifest.from_json(run.child(SUCCESS_MARKER).read_bytes()) == newer


# --- readers check the claim a marker was committed under ---------------------------------------------------


def test_a_committed_marker_whose_claim_is_gone_does_not_pass(run, proxy):
    """A newer try's revoke deletes the claim before anything else; a marker that stands without it
    (a zombie's in its window, a withdrawal that failed, a clean-up that stopped half-way) is
    refused, also by a reader that already checked this very marker's files."""
    rundir.commit(through(proxy.start(), run), write_attempt(run, "t01aaaa", [1, 2, 3]))
    verdicts = Verdicts()
    read = lambda: read_valid_manifest(run.location, options(proxy.endpoint), verdicts=verdicts)  # noqa: E731
    assert read().job.attempt == "t01aaaa"
    claims_for(run).revoke()  # what a newer try's clean-up does first
    assert run.child(SUCCESS_MARKER).exists() and not run.child(JOB_SPEC_FILE).exists()
    with pytest.raises(ManifestError, match=r"committed by attempt t01aaaa under the claim .*_job.json, which is gone"):
        read()
    with pytest.raises(ManifestError, match="which is gone"):
        read_valid_manifest(run.location, options(proxy.endpoint), verify_checksums=True)


def test_a_claim_written_again_after_the_commit_does_not_pass(run, proxy):
    manifest = write_attempt(run, "t01aaaa", [1, 2])
    rundir.commit(through(proxy.start(), run), manifest)
    job = run.child(JOB_SPEC_FILE)
    job.write_bytes(job.read_bytes() + b"\n")  # same attempt, another version
    with pytest.raises(ManifestError, match="the claim was written again after the commit"):
        read_valid_manifest(run.location, options(proxy.endpoint))


def test_a_marker_that_records_no_claim_is_checked_as_before(run, s3_server):
    """Markers committed before S3 markers recorded their claim (and markers put by hand) cannot
    say whether a claim is expected: without one they pass on their files, as they did."""
    manifest = write_attempt(run, "t01aaaa", [1, 2])
    run.child(SUCCESS_MARKER).write_bytes(manifest.to_json().encode())  # no metadata
    run.child(JOB_SPEC_FILE).delete()
    assert read_valid_manifest(run.location, options(s3_server)) == manifest


def test_a_refused_store_keeps_the_run_an_overwrite_would_have_replaced(
    proxy, s3_server, s3_bucket, monkeypatch, tmp_path
):
    """An OVERWRITE deletes the earlier run before its claim: on a store that cannot fence a commit,
    the task is refused before the save mode touches anything, so the committed run stays whole."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec
    from airflow_provider_batchinfer.contract import RunOwner

    root = s3_task_setup(proxy, s3_server, s3_bucket, monkeypatch, tmp_path)
    ti = TaskInstanceStandIn(try_number=2)
    owner = RunOwner(dag_id=ti.dag_id, task_id=ti.task_id, run_id=ti.run_id, try_number=1)
    out = Stage.open(f"{root}/out/run1", options(s3_server))
    rundir.commit(out, write_attempt(out, "t01aaaa", [1, 2], owner=owner))  # on the store itself, fenced
    before = contents(out)
    assert SUCCESS_MARKER in before
    proxy.start(STORES["strip"][0])
    task = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=f"{root}/input",
        output_spec=OutputSpec(stage_location=out.location, mode=SaveMode.OVERWRITE),
    )
    with pytest.raises(AirflowFailException, match="nothing in it was changed and no job was started"):
        task.execute({"ti": ti})
    assert contents(out) == before  # the committed run, its claim and its parts, as they were
    assert read_valid_manifest(out.location, options(s3_server)).job.attempt == "t01aaaa"


def s3_task_setup(proxy, s3_server, s3_bucket, monkeypatch, tmp_path) -> str:
    """A task's world on the S3 server, reached through the proxy: the connection (keys, roots), a
    logged model and a 10-row input. Returns the bucket's root."""
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import TextLength

    root = f"s3://{s3_bucket}"
    extra = {"endpoint_url": proxy.endpoint, "region_name": "us-east-1", "s3_max_attempts": 1}
    extra |= {"stage_root": f"{root}/stage", "registry_root": f"{root}/registry"}
    connection = {"conn_type": "batchinfer", "login": KEY_ID, "password": SECRET, "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_BATCHINFER_DEFAULT", json.dumps(connection))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(tmp_path / "model-cache"))
    ModelRegistry(f"{root}/registry", options(s3_server)).log_model(
        "text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE
    )
    sink = io.BytesIO()
    pq.write_table(pa.table({"ticket_id": pa.array(range(10), pa.int64()), "text": ["t"] * 10}), sink)
    Stage.open(f"{root}/input/tickets.parquet", options(s3_server)).write_bytes(sink.getvalue())
    return root
