"""S3 failures on real sockets: a store that crashes mid-write, throttling, server errors, access denied.

Every client (the operator, the runtime, its Ray workers) talks to ``moto_server`` through
``tests/s3_proxy.py``, a separate process that forwards requests unchanged except the ones a rule
answers itself (an S3 error response) or dies on (the process exits mid-request, like a crashed
store, and a new proxy is started on the same port; moto keeps what was written before, as a real
store would). The test data is put straight into moto, around the proxy.

The operator is driven directly (``execute`` with the task instance's identity) where the point is
the operator's own decision (retryable ``AirflowException`` vs ``AirflowFailException``, which is
what Airflow's retry logic acts on); scheduling retries through ``dag.test()`` is covered in
``test_end_to_end.py``.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER
from airflow_provider_batchinfer.registry.fetch import cached_copy
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.s3 import S3StageError
from airflow_provider_batchinfer.store.stage import Stage
from tests.s3_proxy import FaultProxy

KEY_ID, SECRET = "AKIDFAULTTEST", "fault-secret"


@pytest.fixture
def proxy(s3_server, tmp_path):
    fault_proxy = FaultProxy(s3_server, tmp_path / "proxy.log")
    yield fault_proxy
    fault_proxy.stop()


def direct(s3_server: str) -> dict:
    """Storage options that reach moto itself, around the proxy: how the tests set up and inspect."""
    return {"endpoint_url": s3_server, "region": "us-east-1", "access_key": KEY_ID, "secret_key": SECRET}


def via(proxy: FaultProxy, max_attempts: int = 3) -> dict:
    return {
        "endpoint_url": proxy.endpoint,
        "region": "us-east-1",
        "access_key": KEY_ID,
        "secret_key": SECRET,
        "max_attempts": max_attempts,
    }


@pytest.fixture
def world(s3_server, s3_bucket, proxy, monkeypatch, tmp_path):
    """``batchinfer_default`` pointing at the proxy; a model (TextLength) and 500 tickets in 4 files
    put into moto directly."""
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import TextLength

    bucket = f"s3://{s3_bucket}"
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCHINFER_DEFAULT",
        json.dumps(
            {
                "conn_type": "batchinfer",
                "login": KEY_ID,
                "password": SECRET,
                "extra": {
                    "endpoint_url": proxy.endpoint,
                    "region_name": "us-east-1",
                    "s3_max_attempts": 3,
                    "stage_root": f"{bucket}/stage",
                    "registry_root": f"{bucket}/registry",
                },
            }
        ),
    )
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "model-cache"
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(cache))
    model = ModelRegistry(f"{bucket}/registry", direct(s3_server)).log_model(
        "text_length",
        "v1",
        "python",
        python_class=TextLength,
        signature={"inputs": {"text": "string"}, "outputs": {"length": "int64"}},
    )
    table = pa.table(
        {
            "ticket_id": pa.array(range(500), pa.int64()),
            "text": [f"ticket {i}: " + "slow export " * (i % 5) for i in range(500)],
        }
    )
    for n in range(4):
        sink = io.BytesIO()
        pq.write_table(table.slice(n * 125, 125), sink)
        Stage.open(f"{bucket}/input/tickets-{n}.parquet", direct(s3_server)).write_bytes(sink.getvalue())
    return SimpleNamespace(bucket=s3_bucket, root=bucket, model=model, input=f"{bucket}/input", rows=500, cache=cache)


def operator(input: str, out: str):
    """A fresh operator, as Airflow builds one for every try."""
    from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec

    return BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=input,
        output_spec=OutputSpec(stage_location=out),  # SaveMode.ERROR, the default
        job_spec=JobSpec(max_batch_rows=100, progress_interval_s=2),
    )


def context(try_number: int) -> dict:
    """The task instance's identity, as the operator reads it (dag, task, run, try, map index)."""
    return {
        "ti": SimpleNamespace(
            dag_id="bi_s3_faults",
            task_id="infer",
            run_id="scheduled__2026-11-23T00:00:00+00:00",
            try_number=try_number,
            map_index=-1,
        )
    }


def listing(s3_server: str, location: str) -> dict[str, int]:
    return dict(Stage.open(location, direct(s3_server)).list_files())


# --- the stage layer against injected errors (no Airflow, no Ray) ----------------------------------------


def test_throttling_and_server_errors_are_retried_and_outlasting_them_is_a_retryable_error(s3_server, s3_bucket, proxy):
    out = f"s3://{s3_bucket}/flaky/run1"
    proxy.start(
        {"match": f"PUT /{s3_bucket}/flaky/run1/a", "status": 503, "code": "SlowDown", "times": 2},
        {"match": f"GET /{s3_bucket}\\?.*prefix=flaky", "status": 500, "code": "InternalError", "times": 1},
    )
    stage = Stage.open(out, via(proxy, max_attempts=3))
    stage.child("a").write_bytes(b"payload")
    assert stage.list_files() == [("a", 7)]
    seen = [(r["method"], r["injected"], r["status"]) for r in proxy.requests()]
    assert seen.count(("PUT", "SlowDown", 503)) == 2 and seen.count(("GET", "InternalError", 500)) == 1
    assert listing(s3_server, out) == {"a": 7}  # written once, whatever the retries

    # more failures than attempts: a retryable error (Airflow's retries may still win) naming bucket and key
    proxy.start({"match": f"PUT /{s3_bucket}/flaky/run1/b", "status": 503, "code": "SlowDown"})
    with pytest.raises(
        S3StageError, match=rf"write failed for bucket '{s3_bucket}', key 'flaky/run1/b'.*SLOW_DOWN"
    ) as info:
        Stage.open(out, via(proxy, max_attempts=2)).child("b").write_bytes(b"x")
    assert not info.value.permanent
    assert listing(s3_server, out) == {"a": 7}


@pytest.mark.usefixtures("airflow_db")
@pytest.mark.parametrize(
    ("rule", "operation", "key"),
    [
        # the credentials may list the output prefix but not write to it: the claim's conditional-write
        # probe (before the job spec) is the first write
        (
            {"match": "PUT /{bucket}/out/run1/", "status": 403, "code": "AccessDenied"},
            "conditional write",
            r"out/run1/_probe/t01\w+-\w+",
        ),
        # nor read the input
        ({"match": "(HEAD|GET) /{bucket}/input", "status": 403, "code": "AccessDenied"}, "look up", "input"),
    ],
)
def test_access_denied_fails_at_once_without_retries_naming_bucket_and_key(
    world, proxy, s3_server, rule, operation, key
):
    from airflow.sdk.exceptions import AirflowFailException

    proxy.start({**rule, "match": rule["match"].format(bucket=world.bucket)})
    op = operator(world.input, f"{world.root}/out/run1")
    with pytest.raises(
        AirflowFailException,
        match=rf"S3 {operation} failed for bucket '{world.bucket}', key "
        rf"'{key}'.*(ACCESS_DENIED|AccessDenied)",
    ):
        op.execute(context(1))
    assert listing(s3_server, f"{world.root}/out/run1") == {}  # nothing written, nothing to clean up
    assert any(r["injected"] == "AccessDenied" for r in proxy.requests())


# --- the runtime against a crashing store --------------------------------------------------------------------


@pytest.mark.usefixtures("airflow_db", "ray_cluster")
def test_store_crashing_mid_write_fails_the_try_retryably_then_the_retry_commits_one_clean_set(
    world, proxy, s3_server, capfd
):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    out = f"{world.root}/out/run1"
    parts = f"PUT /{world.bucket}/out/run1/part-"
    # try 1: the store dies while the bytes of a part are being uploaded
    proxy.start({"match": parts, "action": "die"})
    op = operator(world.input, out)
    with pytest.raises(AirflowException) as info:
        op.execute(context(1))
    assert not isinstance(info.value, AirflowFailException)  # an outage: Airflow's retry applies
    assert f"bucket '{world.bucket}'" in str(info.value) and "connect" in str(info.value).lower()
    assert not proxy.alive() and any(r["injected"] == "die" for r in proxy.requests())
    # nothing committed, and no half object either: S3 publishes an upload whole or not at all
    assert list(listing(s3_server, out)) == [JOB_SPEC_FILE]
    first_attempt = Stage.open(out, direct(s3_server)).child(JOB_SPEC_FILE).read_json()["attempt"]

    # the store is back (same endpoint, moto kept the objects) and throttles the retry's first uploads
    seen = len(proxy.requests())
    proxy.start({"match": parts, "status": 503, "code": "SlowDown", "times": 2})
    retry = operator(world.input, out)
    result = retry.execute(context(2))
    assert f"retry clean-up: removed 1 file(s) (no {SUCCESS_MARKER}) from {out}" in capfd.readouterr().out
    assert result["rows"] == world.rows and result["attempt"].startswith("t02")
    manifest = read_valid_manifest(out, direct(s3_server)).to_dict()
    assert manifest["counts"] == {"input_rows": 500, "output_rows": 500, "error_rows": 0}
    names = sorted(f["name"] for f in manifest["files"])
    assert sorted(listing(s3_server, out)) == sorted([JOB_SPEC_FILE, SUCCESS_MARKER, *names])
    assert all(first_attempt not in name for name in names)  # try 1's parts were removed, not merged
    fs = Stage.open(out, direct(s3_server)).fs
    rows = pq.read_table([f"{world.bucket}/out/run1/{n}" for n in names], filesystem=fs)
    assert sorted(rows.column("ticket_id").to_pylist()) == list(range(500))
    injected = [r for r in proxy.requests(seen) if r["injected"]]
    assert [r["injected"] for r in injected] == ["SlowDown", "SlowDown"]
    # the model reached the actor through its node's cache (the configured one), keyed by its sha256
    assert (cached_copy(world.cache, world.model.uri, world.model.sha256) / "MODEL.json").exists()


# --- how a failure inside a Ray task reaches the task log and the retry decision -------------------------


@pytest.mark.parametrize(
    ("detail", "unreachable", "permanent"),
    [
        (
            "AWS Error NETWORK_CONNECTION during UploadPart operation: curlCode: 7, Could not connect to server",
            True,
            False,
        ),
        ("AWS Error ACCESS_DENIED during UploadPart operation: Access Denied", False, True),
    ],
)
def test_a_failed_write_task_reports_our_message_and_only_denials_are_permanent(detail, unreachable, permanent):
    """Ray Data raises a failed datasink write as RayTaskError(S3StageError) "from SystemException()"
    and appends its retry advice to the message; the task log must still get our line, and the
    operator must still learn whether a retry can help."""
    from ray.data.exceptions import SystemException
    from ray.exceptions import RayTaskError

    from airflow_provider_batchinfer.runtime.reporting import _root_message, is_permanent

    cause = S3StageError(
        f"S3 write failed for bucket 'b', key 'out/part-0.parquet' (s3://b/out/part-0.parquet): {detail}"
    )
    cause.unreachable, cause.permanent = unreachable, True
    cause.args = (
        cause.args[0] + "\nFailed to write after 1/1 attempts (total backoff 0.0s).\nTo change retry "
        "attempts, configure `ray.data.DataContext.get_current()` if you believe this to be transient.",
    )
    wrapped = RayTaskError("Write", "Traceback (most recent call last): ...", cause).as_instanceof_cause()
    try:
        try:
            raise StopIteration  # what Ray Data was handling when the write's error arrived
        except StopIteration:
            raise wrapped from SystemException()
    except Exception as exc:
        assert (
            _root_message(exc) == f"S3StageError: S3 write failed for bucket 'b', key 'out/part-0.parquet' "
            f"(s3://b/out/part-0.parquet): {detail}"
        )
        assert is_permanent(exc) is permanent  # a store that vanished mid-job is an outage: retry


# --- object-store models: vetted by listing on the Airflow side, fetched per node by the actors -------------


@pytest.mark.usefixtures("airflow_db")
def test_the_airflow_side_vets_an_s3_model_by_listing_and_never_downloads_it(world, proxy, s3_server):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook
    from airflow_provider_batchinfer.registry import TamperedModelError

    proxy.start()
    hook = ModelServiceHook()
    assert hook.get_model("text_length", "v1") == world.model
    assert not world.cache.exists()  # nothing was downloaded onto the Airflow worker
    assert not [r for r in proxy.requests() if r["method"] == "GET" and "/registry/text_length/v1/code/" in r["target"]]

    version = Stage.open(f"{world.root}/registry/text_length/v1", direct(s3_server))
    code = next(name for name, _ in version.list_files() if name.startswith("code/"))
    original = version.child(*code.split("/")).read_bytes()
    changed = original + b"\n# changed\n"
    version.child(*code.split("/")).write_bytes(changed)
    with pytest.raises(
        TamperedModelError,
        match=rf"{code} is {len(changed)} bytes but was {len(original)} when "
        r"logged",
    ):
        hook.get_model("text_length", "v1")
    version.child(*code.split("/")).write_bytes(original)
    version.child("artifact", "extra.bin").write_bytes(b"x")
    with pytest.raises(TamperedModelError, match="artifact/extra.bin was added after the model was logged"):
        hook.get_model("text_length", "v1")


def test_two_versions_with_the_same_files_each_load_their_own_manifest_from_the_cache(world, s3_server):
    """``SlowLength`` logged from the same ``tests/models.py`` as the world's ``TextLength`` has the
    same files but loads another class. A node that cached one must not serve its manifest for the
    other: the digest covers MODEL.json's class, and the cache is keyed by location as well (a version
    logged in the files-only format has one sha256 for both)."""
    from airflow_provider_batchinfer.registry import ModelRegistry, fetch_version
    from tests.models import SlowLength

    slow = ModelRegistry(f"{world.root}/registry", direct(s3_server)).log_model(
        "slow_length", "v1", "python", python_class=SlowLength, signature=world.model.signature
    )
    assert slow.sha256 != world.model.sha256  # same files, another class: another digest
    text_dir, text_manifest = fetch_version(world.model.uri, world.model.sha256, direct(s3_server))
    slow_dir, slow_manifest = fetch_version(slow.uri, slow.sha256, direct(s3_server))
    assert (text_manifest["name"], text_manifest["options"]["class"]) == ("text_length", "TextLength")
    assert (slow_manifest["name"], slow_manifest["options"]["class"]) == ("slow_length", "SlowLength")
    assert text_manifest["files"] == slow_manifest["files"]
    assert text_dir != slow_dir and slow_dir.parent == world.cache / slow.sha256


def test_each_replica_fetches_the_model_on_its_node_and_a_bad_cache_is_fetched_again(world, s3_server):
    """What every Ray actor (``ModelReplica``) does before loading: download into its node's cache
    under the pinned sha256 (concurrent replicas race safely), verify, and never trust a damaged
    cached copy. The Ray run in this file shows an actor doing it."""
    from concurrent.futures import ThreadPoolExecutor

    from airflow_provider_batchinfer.registry import TamperedModelError, fetch_version

    uri, sha = world.model.uri, world.model.sha256
    with ThreadPoolExecutor(4) as pool:  # four replicas starting at once on one node
        copies = list(pool.map(lambda _: fetch_version(uri, sha, direct(s3_server))[0], range(4)))
    cached = cached_copy(world.cache, uri, sha)
    assert set(copies) == {cached} and sorted(p.name for p in world.cache.iterdir()) == [sha]
    assert sorted(p.name for p in (world.cache / sha).iterdir()) == [cached.name]  # no download left behind

    code = next((cached / "code").iterdir())
    code.write_text(code.read_text() + "\n# damaged on this node\n")
    path, manifest = fetch_version(uri, sha, direct(s3_server))  # dropped and downloaded again
    assert manifest["sha256"] == sha and "damaged" not in (path / "code" / code.name).read_text()

    # the registry's own copy changed (same size, so no listing sees it): refused, naming the source
    remote = Stage.open(f"{uri}/code/{code.name}", direct(s3_server))
    data = remote.read_bytes()
    remote.write_bytes(data[:-1] + (b"#" if data[-1:] != b"#" else b" "))
    (path / "code" / code.name).write_text("damaged again")
    with pytest.raises(
        TamperedModelError,
        match=rf"does not match its recorded sha256.*downloaded just now from "
        rf"{uri}",
    ):
        fetch_version(uri, sha, direct(s3_server))
