"""What a run cost (the manifest's ``usage`` section, XCom, the lineage facet) and the budget
(``JobSpec(max_cost=...)``, ``max_output_tokens_total``). Unit tests check the contract, the specs
and the budget's deadline without Ray; two jobs on the session's Ray cluster, run through
``BatchInferenceOperator.execute`` as a task runs them, check a real stop followed by a RESUME retry
with a higher budget, and the retry's real usage section.
"""

from __future__ import annotations

import fcntl
import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import Manifest
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec, SaveMode, SpecError
from airflow_provider_batchinfer.contract.usage import BASIS, Usage, check_prices, estimate_cost
from airflow_provider_batchinfer.runtime.model.usage import (
    STOP_MARGIN_S,
    BudgetError,
    Meter,
    UsageCounter,
    batch_tokens,
    percentile,
)
from tests.models import TextLength, committed_manifest, job_file, write_tickets
from tests.runs import manifest_for, write_part
from tests.task_context import TaskInstanceStandIn
from tests.usage_support import GatedLength

from airflow.sdk.exceptions import AirflowFailException  # isort: skip

SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
PRICE = 3600.0  # per CPU hour: one currency unit per CPU-second, so the figures are easy to read


# --- the contract, the specs, the connection ---------------------------------------------------------


def test_budget_specs_are_checked_when_the_dag_is_parsed():
    assert JobSpec(max_cost=2.5, max_output_tokens_total=1000).to_dict()["max_cost"] == 2.5
    for bad in (0, -1, "5", True, float("inf")):
        with pytest.raises(SpecError, match=r"JobSpec.max_cost is the most a run may cost .*JobSpec\(max_cost=2.5\)"):
            JobSpec(max_cost=bad)
    for bad in (0, 1.5, "10", False):
        with pytest.raises(SpecError, match=r"max_output_tokens_total .* whole number >= 1"):
            JobSpec(max_output_tokens_total=bad)
    assert JobSpec.from_dict(JobSpec(max_cost=1.0).to_dict()) == JobSpec(max_cost=1.0)


def test_prices_come_from_the_connection_and_travel_in_the_job_file(tmp_path):
    from airflow.sdk import Connection

    from airflow_provider_batchinfer.contract import JobFile
    from airflow_provider_batchinfer.hooks.connection_fields import conn_fields
    from airflow_provider_batchinfer.hooks.service_config import ServiceConfig
    from airflow_provider_batchinfer.registry import ModelRegistry

    def conn(**extra: object) -> Connection:
        return Connection(conn_id="priced", conn_type="batchinfer", extra=json.dumps(extra))

    config = ServiceConfig.from_connection(
        conn(stage_root=str(tmp_path), price_per_cpu_hour="0.048", price_per_gpu_hour=2.5), "priced"
    )
    assert config.prices == {"price_per_cpu_hour": 0.048, "price_per_gpu_hour": 2.5}
    assert config.to_dict()["prices"] == config.prices
    with pytest.raises(ValueError, match=r"connection 'priced': price_per_cpu_hour must be a price per hour .*'cheap'"):
        ServiceConfig.from_connection(conn(price_per_cpu_hour="cheap"), "priced")
    with pytest.raises(ValueError, match="price_per_gpu_hour"):
        check_prices({"price_per_gpu_hour": -1}, "x", ValueError)
    fields = conn_fields()
    assert {"price_per_cpu_hour", "price_per_gpu_hour"} <= set(fields)
    assert fields["price_per_cpu_hour"]["label"] == "Price per CPU hour"

    mv = ModelRegistry(str(tmp_path / "reg")).log_model(
        "text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE
    )
    job = job_file(tmp_path / "out", mv, str(tmp_path / "reg"), [tmp_path / "in"])
    import dataclasses

    priced = dataclasses.replace(job, prices={"price_per_cpu_hour": 0.048})
    assert JobFile.from_json(priced.to_json()).prices == {"price_per_cpu_hour": 0.048}
    assert JobFile.from_json(job.to_json()).prices == {}  # job files without prices still read


def test_usage_section_round_trips_and_old_manifests_still_read(tmp_path):
    part = write_part(tmp_path, "part-00000-t01aaaa.parquet", [1, 2, 3])
    plain = manifest_for(tmp_path, (part,))
    assert "usage" not in plain.to_dict() and Manifest.from_json(plain.to_json()).usage is None
    usage = Usage(
        wall_s=9.0, held_s=6.0, reserved_cpus=2.0, reserved_gpus=0.0, cpu_seconds=12.0, gpu_seconds=0.0, rows=3,
        batches=2, batch_p50_s=0.1, batch_p95_s=0.2, price_per_cpu_hour=PRICE, cost=12.0,
        cost_per_million_rows=4e6,
    )  # fmt: skip
    import dataclasses

    with_usage = dataclasses.replace(plain, usage=usage)
    again = Manifest.from_json(with_usage.to_json())
    assert again.usage == usage and again.to_dict()["usage"]["basis"] == BASIS
    bad = with_usage.to_dict()
    bad["usage"]["cpu_seconds"] = "lots"
    with pytest.raises(Exception, match=r"usage.cpu_seconds must be a number"):
        Manifest.from_dict(bad)
    del bad["usage"]["cpu_seconds"]
    with pytest.raises(Exception, match=r"usage has no \['cpu_seconds'\]"):
        Manifest.from_dict(bad)


def test_percentiles_tokens_and_cost_arithmetic():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 95) == 4.0
    assert percentile(sorted(float(i) for i in range(1, 101)), 95) == 95.0
    assert estimate_cost(3600.0, 0.0, {}) is None
    assert estimate_cost(7200.0, 1800.0, {"price_per_cpu_hour": 0.5, "price_per_gpu_hour": 2.0}) == 2.0

    from airflow_provider_batchinfer.contract.chat import response_types

    _, usage_type = response_types()
    scored = pa.table(
        {
            "id": [1, 2, 3],
            "usage": pa.array(
                [
                    {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
                    None,  # a dead-lettered row
                    {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
                ],
                usage_type,
            ),
        }
    )
    assert batch_tokens(scored) == (17, 9)
    assert batch_tokens(pa.table({"id": [1], "usage": ["not a struct"]})) is None
    assert batch_tokens(pa.table({"length": [3]})) is None

    counter = UsageCounter()
    for seconds in (0.3, 0.1, 0.2):
        counter.add(10)
        counter.batch(10, seconds, (5, 2))
    summary = counter.summary()
    assert summary["batches"] == 3 and summary["batch_p50_s"] == 0.2 and summary["batch_p95_s"] == 0.3
    assert (summary["input_tokens"], summary["output_tokens"]) == (15, 6)
    assert counter.budget_view() == (30, 6)


def test_a_text_generation_batch_reports_its_tokens(registry, tmp_path):
    """What the metered replica reports for a real tiny Llama's batch (built in-process): the prompt
    and completion tokens of the model's ``usage`` column."""
    from airflow_provider_batchinfer.contract.chat import text_to_messages
    from airflow_provider_batchinfer.registry.demo_models import build_tiny_chat_model
    from airflow_provider_batchinfer.runtime.model.flavors import load_predictor

    registry.log_model("chat", "v1", "text_generation", str(build_tiny_chat_model(tmp_path / "chat")))
    model_dir = registry.local_copy("chat", "v1")
    predict = load_predictor(model_dir, json.loads((model_dir / "MODEL.json").read_text()), "cpu", 1)
    messages = text_to_messages(pa.table({"text": ["billing fails", "login slow", "export"]}), "{text}")
    out = pa.table(predict(messages.select(["messages"]), {"max_tokens": 6, "temperature": 0}))
    usage = out.column("usage").to_pylist()
    tokens = batch_tokens(out)
    assert tokens == (sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage))
    assert tokens[0] > 0 and 0 < tokens[1] <= 18
    counter = UsageCounter()
    counter.add(3)
    counter.batch(3, 0.5, tokens)
    assert counter.budget_view() == (3, tokens[1]) and counter.summary()["input_tokens"] == tokens[0]


def _meter(tmp_path, registry, model, **spec) -> Meter:
    import dataclasses

    job = dataclasses.replace(
        job_file(tmp_path / "out", model, registry.root, [tmp_path / "in"], job_spec=JobSpec(**spec)),
        prices={"price_per_cpu_hour": PRICE},
    )
    pool = {"reserved_cpus": 2.0, "reserved_gpus": 0.0}
    return Meter(job, pool, counter=None, todo_rows=1000)  # type: ignore[arg-type]


def test_max_cost_is_a_deadline_known_before_the_write_starts(tmp_path, registry, text_length_model):
    """2 CPUs at one unit per CPU-second and max_cost=10: the estimate reaches the limit after 5 s
    held, so the job stops at 4 s (STOP_MARGIN_S before it); Ray Data's loop calls ``step``, which
    raises Ray Data's timeout error, swallowed by the meter and turned into the budget's message."""
    meter = _meter(tmp_path, registry, text_length_model, max_cost=10.0)
    assert meter.deadline_s() == pytest.approx(5.0 - STOP_MARGIN_S)
    assert _meter(tmp_path, registry, text_length_model, max_cost=1.0).deadline_s() == pytest.approx(0.25)
    assert _meter(tmp_path, registry, text_length_model, max_output_tokens_total=5).deadline_s() is None

    from ray.data.exceptions import ExecutionTimeoutError

    with meter:
        meter.started = 100.0
        meter.step(now=103.9)  # within the deadline: nothing happens
        with pytest.raises(ExecutionTimeoutError, match=r"stopped by JobSpec.max_cost"):
            meter.step(now=104.0)
        meter.step(now=104.0)  # the stop, raised again into the write: the meter swallows it
    assert meter.stopped == ("cost", pytest.approx(4.0))
    with pytest.raises(
        BudgetError,
        match=r"^stopped: the estimated cost would exceed JobSpec.max_cost=10: 8 after 4.0s holding 2 CPU / 0 GPU, "
        r"0 of 1,000 rows scored. Nothing was committed; .*RESUME",
    ):
        meter.check(str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="a replica failed"), _meter(tmp_path, registry, text_length_model):
        raise RuntimeError("a replica failed")  # an error that is not the budget's passes through


def test_the_finished_job_is_checked_against_its_limits(tmp_path, registry, text_length_model):
    """A write that ends between Ray Data's steps is checked once more: past the deadline but within
    max_cost it commits; over max_cost or over max_output_tokens_total it does not."""
    meter = _meter(tmp_path, registry, text_length_model, max_cost=10.0)
    meter.started, meter.ended = 100.0, 104.5  # 9 of 10
    meter.check(str(tmp_path / "out"))
    meter.ended = 106.0  # 12 of 10
    with pytest.raises(BudgetError, match=r"cost exceeded JobSpec.max_cost=10: 12 after 6.0s holding 2 CPU / 0 GPU"):
        meter.check(str(tmp_path / "out"))

    tokens = _meter(tmp_path, registry, text_length_model, max_output_tokens_total=100)
    tokens.started = 100.0
    tokens.seen = (10, 100)  # at the limit is within it
    tokens.step(now=200.0)
    tokens.check(str(tmp_path / "out"))
    tokens.seen = (11, 101)
    with pytest.raises(Exception, match=r"stopped by JobSpec.max_output_tokens_total"):
        tokens.step(now=200.0)
    with pytest.raises(
        BudgetError, match=r"^stopped: 101 output tokens exceed JobSpec.max_output_tokens_total=100 after 11 of 1,000"
    ):
        tokens.check(str(tmp_path / "out"))


def test_a_budget_the_job_cannot_enforce_fails_before_ray_starts(tmp_path, registry, text_length_model, monkeypatch):
    """``max_cost`` without prices, ``max_output_tokens_total`` on a model that writes no tokens:
    permanent errors, before any compute (``ray.init`` is made to fail), with what to change."""
    import ray

    from airflow_provider_batchinfer.runtime.driver import run
    from airflow_provider_batchinfer.runtime.reporting import failure
    from tests.models import write_job_file

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    inputs = write_tickets(tmp_path / "in", rows=20, files=1)
    for spec, message in (
        (JobSpec(max_cost=5.0), r"JobSpec.max_cost=5 needs prices .*price_per_cpu_hour on the batchinfer connection"),
        (JobSpec(num_cpus=0, num_gpus=1, max_cost=5.0), r"needs prices .* set the extras price_per_gpu_hour"),
        (
            JobSpec(max_output_tokens_total=10),
            r"max_output_tokens_total applies to text_generation models; text_length/v1 is python",
        ),
    ):
        run_dir = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        run_dir.mkdir()
        job = job_file(run_dir, text_length_model, registry.root, [inputs], job_spec=spec)
        with pytest.raises(BudgetError, match=message) as caught:
            run(write_job_file(job))
        assert failure(caught.value).permanent
        assert {p.name for p in run_dir.iterdir()} <= {"_job.json", "_claims"}  # the claim only: no part, no _SUCCESS


# --- jobs on the session's Ray cluster -----------------------------------------------------------------


@pytest.fixture(scope="module")
def priced(tmp_path_factory, airflow_db, ray_cluster):
    """A ``batchinfer`` connection with a CPU price, and a registry with the two test models."""
    from airflow_provider_batchinfer.registry import ModelRegistry

    root = tmp_path_factory.mktemp("usage")
    registry = ModelRegistry(str(root / "registry"))
    registry.log_model("text_length", "v1", "python", python_class=TextLength, signature=SIGNATURE)
    registry.log_model("gated_length", "v1", "python", python_class=GatedLength, signature=SIGNATURE)
    conn = {
        "conn_type": "batchinfer",
        "extra": {"stage_root": str(root / "stage"), "registry_root": registry.root, "price_per_cpu_hour": PRICE},
    }
    patch = pytest.MonkeyPatch()
    patch.setenv("AIRFLOW_CONN_BI_PRICED", json.dumps(conn))
    yield root
    patch.undo()


def _operator(inputs: Path, out: Path, model: str, mode: SaveMode = SaveMode.ERROR, params=None, **job):
    from airflow_provider_batchinfer import BatchInferenceOperator

    return BatchInferenceOperator(
        task_id="infer",
        model=model,
        version="v1",
        input=str(inputs),
        input_spec=InputSpec(id_column="ticket_id", params=params or {}),
        output_spec=OutputSpec(stage_location=str(out), mode=mode),
        job_spec=JobSpec(**{"max_batch_rows": 100, "progress_interval_s": 1, **job}),
        model_service_conn_id="bi_priced",
    )


def _complete_parts(out: Path) -> dict[str, int]:
    done = {}
    for part in sorted(out.glob("part-*.parquet")):
        try:
            done[part.name] = pq.read_metadata(part).num_rows
        except Exception:  # cut off mid-write when the job was stopped
            pass
    return done


def _settled(out: Path, quiet_s: float = 2.0, timeout: float = 30) -> None:
    """Wait until no part changes for ``quiet_s``: the stopped driver's Ray workers are gone."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = sorted((p.name, p.stat().st_size) for p in out.glob("part-*.parquet"))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


BUDGET_ROWS = 900


@pytest.fixture(scope="module")
def budget_run(priced, ray_cluster, tmp_path_factory):
    """A job stopped by ``max_cost``, then its RESUME retry with a higher budget, on the session's
    cluster. The replica scores its first 6 batches at once and then waits on a gate the test holds
    locked, so the job holds its reservation (2 CPUs x 1 unit per CPU-second) until ``max_cost``'s
    deadline; the retry runs with the gate open. rows_per_part=50: the 6 fast batches become complete
    parts before the budget stops the job, so the RESUME has parts to keep.

    Returns the stop's message (None: the first try did not fail permanently), the complete parts
    left after it, and the retry's operator and XCom."""
    root = tmp_path_factory.mktemp("budget")
    inputs = write_tickets(root / "in", rows=BUDGET_ROWS, files=9)
    out, gate = root / "out", root / "gate"
    gate.write_text("closed")
    params = {"gate": str(gate), "fast_batches": 6}
    job = {"max_batch_rows": 50, "rows_per_part": 50}
    first = _operator(inputs, out, "gated_length", SaveMode.RESUME, params, max_cost=30.0, **job)
    message = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ADDRESS", ray_cluster["address"])  # set up before any test's own RAY_ADDRESS
        with open(gate) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                first.execute({"ti": TaskInstanceStandIn(try_number=1)})
            except AirflowFailException as exc:  # permanent: a retry would spend the same
                message = str(exc)
        print("budget stop:", message)
        committed_after_stop = (out / "_SUCCESS").exists()
        _settled(out)
        kept = _complete_parts(out)
        print("kept before the stop:", kept)
        gate.unlink()
        retry = _operator(inputs, out, "gated_length", SaveMode.RESUME, params, max_cost=1e6, **job)
        xcom = retry.execute({"ti": TaskInstanceStandIn(try_number=2)})
    return {
        "message": message,
        "committed_after_stop": committed_after_stop,
        "out": out,
        "kept": kept,
        "retry": retry,
        "xcom": xcom,
    }


def test_the_budget_guard_stops_the_job_and_a_resume_with_a_higher_budget_completes(budget_run):
    """The stopped task fails permanently, saying how far it got, and commits nothing; the RESUME
    retry keeps whatever parts were complete and scores only the rest."""
    message, out, kept = budget_run["message"], budget_run["out"], budget_run["kept"]
    assert message is not None, "the first try was not stopped by its budget"
    found = re.search(
        r"stopped: the estimated cost (?:would exceed|exceeded) JobSpec.max_cost=30: ([\d.]+) after ([\d.]+)s holding ([\d.]+) CPU "
        r"/ 0 GPU, ([\d,]+) of 900 rows scored\. Nothing was committed; complete parts stay in (\S+) without _SUCCESS\. "
        r"Raise the limit and retry \(with SaveMode.RESUME",
        message,
    )
    assert found, message
    cost, held, cpus, done = float(found[1]), float(found[2]), float(found[3]), int(found[4].replace(",", ""))
    assert cost == pytest.approx(cpus * held, abs=0.2) and found[5] == str(out)
    assert held >= round(max(30.0 / cpus - STOP_MARGIN_S, 15.0 / cpus), 1)  # stopped at max_cost's deadline, not before
    assert done < BUDGET_ROWS
    assert not budget_run["committed_after_stop"]
    # the parts written before the stop, each whole (usually several: the 6 fast batches; none when
    # the replica's start took most of the budget's 15 s, as on a machine loaded far past its cores)
    assert sum(kept.values()) < BUDGET_ROWS, kept

    manifest = Manifest.from_dict(committed_manifest(str(out)))
    assert manifest.resume.resumed and manifest.resume.kept_rows == sum(kept.values()), kept
    assert manifest.resume.processed_rows == BUDGET_ROWS - manifest.resume.kept_rows
    assert set(kept) <= set(manifest.file_names)
    ids = pq.read_table([str(out / name) for name in manifest.file_names]).column("ticket_id").to_pylist()
    assert sorted(ids) == list(range(BUDGET_ROWS))  # every row exactly once
    xcom = budget_run["xcom"]
    assert manifest.usage is not None and xcom["usage"]["rows"] == manifest.usage.rows == manifest.resume.processed_rows


def test_the_usage_section_is_present_and_plausible(budget_run):
    """The retry's usage section (in the manifest, XCom and the lineage run facet): what it held,
    for how long, at what price, for the rows it scored."""
    from airflow_provider_batchinfer.operators.lineage import operator_lineage

    manifest = Manifest.from_dict(committed_manifest(str(budget_run["out"])))
    usage, rows = manifest.usage, manifest.resume.processed_rows
    assert usage is not None and budget_run["xcom"]["usage"] == usage.to_dict()
    print("usage:", json.dumps(usage.to_dict()))
    assert rows > 0 and usage.rows == rows and usage.input_tokens is None and usage.output_tokens is None
    assert 0 < usage.held_s <= usage.wall_s and usage.reserved_cpus >= 1 and usage.reserved_gpus == 0
    assert usage.cpu_seconds > 0 and usage.gpu_seconds == 0
    assert usage.cpu_seconds == pytest.approx(usage.reserved_cpus * usage.held_s, abs=0.01)
    assert usage.cost == pytest.approx(usage.cpu_seconds / 3600 * PRICE)  # CPU-hours x price
    assert usage.cost_per_million_rows == pytest.approx(usage.cost / rows * 1e6, rel=1e-6)
    assert usage.rows_per_s == pytest.approx(rows / usage.held_s, rel=0.01)
    assert usage.batches >= 1 and 0 < usage.batch_p50_s <= usage.batch_p95_s <= usage.busy_s
    assert usage.busy_s <= usage.held_s  # one replica: it cannot be busy longer than it was held
    assert usage.max_cost == 1e6 and usage.price_per_cpu_hour == PRICE
    # the lineage run facet carries the same section
    facet = operator_lineage(budget_run["retry"], TaskInstanceStandIn(try_number=2)).run_facets["batchinference"]
    assert facet.usage == usage.to_dict()
