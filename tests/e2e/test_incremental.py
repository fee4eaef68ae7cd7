"""Incremental scoring (``JobSpec(reuse="unchanged")``) on real parts.

Unit tests first (keys, the manifest section, choosing the earlier run, the parse-time checks; a new
model version and new params reuse nothing), then one module-scoped scenario on the session's Ray
cluster driven through ``BatchInferenceOperator.execute``: 8k products scored, 5% of their texts
changed, rows added and deleted, scored again; the second run must copy the unchanged rows, score
only the rest (counted by the model itself), and equal a full re-score row for row; a damaged key
index falls back to scoring every row. ``dag.test()`` and an ``s3://`` stage run at the end.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, Manifest, ManifestError
from airflow_provider_batchinfer.contract.reuse import key_file_name
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec, SaveMode, SpecError
from airflow_provider_batchinfer.runtime.incremental.keys import context_digest, row_keys
from airflow_provider_batchinfer.store.stage import Stage
from tests import reuse_runs
from tests.incremental_support import (
    SIGNATURE,
    TextFingerprint,
    product_texts,
    tallied,
    write_products,
)
from tests.task_context import TaskInstanceStandIn

CONTEXT = reuse_runs.CONTEXT

# --- keys ------------------------------------------------------------------------------------------------


def _keys(table: pa.Table, columns=("text",), context: str = CONTEXT) -> list[bytes]:
    raw = row_keys(table, list(columns), context)
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def test_a_row_key_is_128_bits_of_its_model_inputs_and_changes_with_any_of_them():
    table = pa.table({"text": ["a", "b", "a", None, ""], "n": pa.array([1, 2, 1, 3, None], pa.int64())})
    keys = _keys(table)
    assert all(len(k) == 16 for k in keys)
    assert keys[0] == keys[2] and len({keys[0], keys[1], keys[3], keys[4]}) == 4  # null != "" != "a"
    both = _keys(table, ("text", "n"))
    assert both[0] == both[2] and both[0] != keys[0]
    # the same values under another context (model, params, schema) never match
    other = context_digest(
        model="m/v2",
        model_sha256="0" * 64,
        flavor="python",
        params={},
        inputs=[("text", "text", "string")],
        outputs={"length": "int64"},
        engine=None,
    )
    assert set(_keys(table, context=other)).isdisjoint(keys)
    # value boundaries are length-prefixed: ("ab", "c") and ("a", "bc") differ
    pair = pa.table({"x": ["ab", "a"], "y": ["c", "bc"]})
    first, second = _keys(pair, ("x", "y"))
    assert first != second


def test_row_keys_cover_numbers_lists_and_nulls_canonically():
    table = pa.table(
        {
            "f": pa.array([0.1, 0.1, None, 2.0], pa.float64()),
            "v": pa.array([[1.0, 2.0], [1.0, 2.0], [1.0], None], pa.list_(pa.float32())),
            "b": pa.array([True, True, False, None]),
        }
    )
    keys = _keys(table, ("f", "v", "b"))
    assert keys[0] == keys[1] and len(set(keys)) == 3
    # a chunked column keys as its combined values
    chunked = pa.Table.from_batches(table.to_batches(max_chunksize=1))
    assert _keys(chunked, ("f", "v", "b")) == keys


@pytest.mark.parametrize(
    "change",
    [
        {"model_sha256": "1" * 64},
        {"params": {"normalize_embeddings": True}},
        {"outputs": {"length": "float64"}},
        {"inputs": [("text", "text", "large_string")]},
        {"model": "m/v1b"},
    ],
)
def test_the_context_changes_with_model_params_schema_and_version(change):
    base = {
        "model": "m/v1",
        "model_sha256": "0" * 64,
        "flavor": "python",
        "params": {},
        "inputs": [("text", "text", "string")],
        "outputs": {"length": "int64"},
        "engine": None,
    }
    assert context_digest(**base) == CONTEXT
    assert context_digest(**{**base, **change}) != CONTEXT


def test_the_gatherer_copies_predictions_from_the_row_groups_that_hold_them(tmp_path):
    import numpy as np

    from airflow_provider_batchinfer.runtime.incremental.scoring import Gatherer
    from airflow_provider_batchinfer.runtime.incremental.source import Source

    for n in range(2):  # two earlier parts, written one row group per batch as the datasink does
        with pq.ParquetWriter(
            tmp_path / f"part-{n}.parquet", pa.schema([("id", pa.int64()), ("y", pa.float64())])
        ) as w:
            for start in range(0, 100, 30):
                ids = np.arange(start, min(start + 30, 100)) + 1000 * n
                w.write_table(pa.table({"id": ids, "y": ids * 0.5}))
    source = Source(str(tmp_path), ("part-0.parquet", "part-1.parquet"), (), ("id",), "")
    parts = np.array([1, 0, 0, 1, 0], np.int32)
    rows = np.array([99, 0, 61, 30, 29], np.int64)
    got = Gatherer(source, None).take(parts, rows)
    assert got.column_names == ["y"]  # passthrough columns come from today's input, never from the old part
    assert got.column("y").to_pylist() == [0.5 * (1000 * p + r) for p, r in zip(parts, rows, strict=True)]


def test_resume_keeps_the_key_files_of_kept_parts_and_drops_broken_ones(tmp_path):
    from airflow_provider_batchinfer.runtime.incremental.scoring import section
    from airflow_provider_batchinfer.runtime.incremental.source import ReusePlan
    from airflow_provider_batchinfer.runtime.rows.resume import nothing_kept
    from tests.runs import write_part

    run = tmp_path / "run"
    kept = nothing_kept()
    for n, reused in ((0, [True, False, True]), (1, None), (2, [True])):  # part 1: key file lost
        part = write_part(run, f"part-{n:05d}-t01a.parquet", [n * 10 + i for i in range(3)])
        kept["files"].append(part)
        if reused is not None:
            path = run / key_file_name(part.name)
            path.parent.mkdir(exist_ok=True)
            keys = pa.array([bytes(16)] * len(reused), pa.binary(16))
            pq.write_table(pa.table({"key": keys, "reused": reused}), path)
    kept["rows"] = 9
    plan = ReusePlan(mode="unchanged", context=CONTEXT, columns=("text",), source=None)
    info = section(plan, Stage.open(str(run)), kept, [], input_rows=9)
    assert info is not None
    # part 2's key file holds 1 key for 3 rows: not trusted; part 1 has none: both scored next time
    assert [e.part for e in info.index] == ["part-00000-t01a.parquet"]
    assert (info.reused_rows, info.scored_rows) == (2, 7)
    entry = info.index[0]
    data = (run / entry.name).read_bytes()
    assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest())


# --- the manifest section ------------------------------------------------------------------------------


_reuse_manifest = reuse_runs.reuse_manifest


def test_the_reuse_section_round_trips_and_old_manifests_still_read(tmp_path):
    manifest = _reuse_manifest(tmp_path / "run")
    again = Manifest.from_json(manifest.to_json())
    assert again.reuse == manifest.reuse and again.reuse.summary() == {
        "reused_rows": 1,
        "scored_rows": 2,
        "reused_from": None,
    }
    plain = manifest.to_dict()
    del plain["reuse"]
    assert Manifest.from_dict(plain).reuse is None


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda r: r["index"][0].update(rows=4), "describes part-00000-t01a.parquet with 4 rows"),
        (lambda r: r.update(scored_rows=5), "reused_rows 1 \\+ scored_rows 5 != input_rows 3"),
        (lambda r: r["index"][0].update(name="_reuse/../x.keys.parquet"), "must be '_reuse/part-00000"),
        (lambda r: r["index"][0].update(reused_rows=7), "reused_rows <= rows"),
        (lambda r: r.update(reused_rows=0, scored_rows=3), "sum of the index's reused_rows"),
    ],
)
def test_a_reuse_section_that_does_not_add_up_is_refused(tmp_path, edit, match):
    data = _reuse_manifest(tmp_path / "run").to_dict()
    edit(data["reuse"])
    with pytest.raises(ManifestError, match=match):
        Manifest.from_dict(data)


def test_xcom_and_the_lineage_run_facet_carry_the_reuse_counts(text_length_model, tmp_path):
    from airflow_provider_batchinfer import BatchInferenceOperator
    from airflow_provider_batchinfer.operators.finalize import committed_result
    from airflow_provider_batchinfer.operators.lineage import RUN_FACET

    run = tmp_path / "base" / "run1"
    manifest = _reuse_manifest(run)
    (run / SUCCESS_MARKER).write_text(manifest.to_json())
    op = BatchInferenceOperator(
        task_id="infer",
        model="text_length",
        version="v1",
        input=str(tmp_path / "in"),
        output_spec=OutputSpec(base_stage_location=str(tmp_path / "base")),
        job_spec=JobSpec(reuse="unchanged"),
    )
    counts = op.get_openlineage_facets_on_complete(TaskInstanceStandIn(run_id="run1")).run_facets[RUN_FACET].counts
    assert counts == {
        "input_rows": 3,
        "output_rows": 3,
        "error_rows": 0,
        "reused_rows": 1,
        "scored_rows": 2,
        "reused_from": None,
    }
    xcom = committed_result(str(run), manifest.job.attempt, {}, op.log)
    assert (xcom["reused_rows"], xcom["scored_rows"], xcom["reused_from"]) == (1, 2, None)


def test_a_run_with_reuse_off_has_no_reuse_section_and_no_reuse_counts(tmp_path):
    """``JobSpec(reuse=None)``: the runtime writes no ``reuse`` section, so XCom has no reuse keys."""
    import dataclasses
    import logging

    from airflow_provider_batchinfer.operators.finalize import committed_result
    from airflow_provider_batchinfer.runtime.incremental.scoring import section
    from airflow_provider_batchinfer.runtime.rows.resume import nothing_kept

    run = tmp_path / "run"
    manifest = dataclasses.replace(
        _reuse_manifest(run), reuse=section(None, Stage.open(str(run)), nothing_kept(), [], 3)
    )
    assert manifest.reuse is None and "reuse" not in json.loads(manifest.to_json())
    (run / SUCCESS_MARKER).write_text(manifest.to_json())
    xcom = committed_result(str(run), manifest.job.attempt, {}, logging.getLogger(__name__))
    assert xcom["rows"] == 3 and not {"reused_rows", "scored_rows", "reused_from"} & set(xcom)


# --- choosing the earlier run ---------------------------------------------------------------------------


_committed = reuse_runs.committed
_source_job = reuse_runs.source_job


def test_the_newest_compatible_valid_run_is_chosen_and_every_skip_is_noted(tmp_path):
    from airflow_provider_batchinfer.runtime.incremental.source import find_source

    base = tmp_path / "base"
    oldest = _committed(base, "d1", "2026-11-20T00:00:00+00:00")
    _committed(base, "d2", "2026-11-21T00:00:00+00:00", context="f" * 64)  # another model: incompatible
    _committed(base, "d3", "2026-11-22T00:00:00+00:00", with_keys=False)  # newest compatible, key file gone
    (base / "d4").mkdir()
    (base / "d4" / SUCCESS_MARKER).write_text("{not json")  # a broken marker
    (base / "d5").mkdir()  # uncommitted: ignored
    (base / "today").mkdir()
    notes: list[str] = []
    source = find_source(Stage.open(str(base)), _source_job(base), CONTEXT, notes)
    assert source is not None and source.run_dir == str(oldest)
    assert source.parts == ("part-00000-t01a.parquet",) and source.indexed_rows == 3
    text = "\n".join(notes)
    assert f"skipped {base / 'd4'}" in text and "not valid JSON" in text
    assert "1 earlier run(s)" in text and "another model sha256" in text
    assert (
        f"skipped {base / 'd3'}" in text and "key file _reuse/part-00000-t01a.parquet.keys.parquet is missing" in text
    )


def test_without_a_compatible_run_nothing_is_reused_and_the_note_says_so(tmp_path):
    from airflow_provider_batchinfer.runtime.incremental.source import find_source

    base = tmp_path / "base"
    _committed(base, "d1", "2026-11-20T00:00:00+00:00", context="f" * 64)
    (base / "d1" / "part-00000-t01a.parquet").write_bytes(b"garbage")  # never even opened: incompatible
    notes: list[str] = []
    assert find_source(Stage.open(str(base)), _source_job(base), CONTEXT, notes) is None
    assert any("no earlier committed run" in n for n in notes)


def test_a_run_directory_outside_a_base_location_is_refused(tmp_path):
    from airflow_provider_batchinfer.runtime.incremental.source import ReuseSpecError, base_of

    job = _source_job(tmp_path, "not-the-run-key")
    job = job.__class__(**{**job.__dict__, "run_dir": str(tmp_path / "fixed")})
    with pytest.raises(ReuseSpecError, match="needs OutputSpec\\(base_stage_location=...\\)"):
        base_of(job)
    assert base_of(_source_job(tmp_path / "b", "run1")).location == str(tmp_path / "b")


def _plan(tmp_path, **input_spec):
    import dataclasses

    from airflow_provider_batchinfer.runtime.planning.pipeline import plan_columns

    job = _source_job(tmp_path / "base", "run1")
    job = dataclasses.replace(
        job, input_spec=InputSpec(**{"id_column": "id", **input_spec}), job_spec=JobSpec(reuse="unchanged")
    )
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, signature={"inputs": {"text": "string"}}))
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    return job, plan_columns(schema, job.model.signature, job.input_spec, "in.parquet"), schema


def test_new_params_give_a_new_context_so_nothing_of_the_old_run_matches(tmp_path):
    from airflow_provider_batchinfer.runtime.incremental.source import plan_reuse

    (tmp_path / "base").mkdir()
    contexts = set()
    for params in ({}, {"salt": "pepper"}, {"salt": "salt"}):
        job, columns, schema = _plan(tmp_path, params=params)
        plan = plan_reuse(job, columns, schema, None)
        assert plan is not None and plan.columns == ("text",) and plan.source is None
        contexts.add(plan.context)
    assert len(contexts) == 3
    job, columns, schema = _plan(tmp_path)
    assert plan_reuse(dataclasses_replace(job, job_spec=JobSpec()), columns, schema, None) is None


def test_a_new_model_version_reuses_nothing_of_the_old_versions_runs(tmp_path):
    """A run of version v1 is the source of the next v1 run; v2 (another version and sha256) gets
    another context and takes nothing from it, so every row goes to the new model."""
    from airflow_provider_batchinfer.runtime.incremental.source import plan_reuse

    job, columns, schema = _plan(tmp_path)
    v1 = plan_reuse(job, columns, schema, None)
    assert v1 is not None and v1.source is None
    earlier = _committed(tmp_path / "base", "d1", "2026-11-20T00:00:00+00:00", context=v1.context)
    again = plan_reuse(job, columns, schema, None)
    assert again is not None and again.source is not None and again.source.run_dir == str(earlier)
    v2 = dataclasses_replace(job, model=dataclasses_replace(job.model, version="v2", sha256="1" * 64))
    plan = plan_reuse(v2, columns, schema, None)
    assert plan is not None and plan.context != v1.context and plan.source is None
    assert any("none of their rows can be reused" in n for n in plan.notes)


@pytest.mark.parametrize(
    ("input_spec", "engine", "match"),
    [
        ({"column_handling": {"text": "bytes"}}, None, "cannot be combined with InputSpec.column_handling"),
        ({}, "vllm", "not supported on the vLLM engine"),
    ],
)
def test_the_runtime_refuses_reuse_it_cannot_key_before_ray(tmp_path, input_spec, engine, match):
    from airflow_provider_batchinfer.runtime.incremental.source import ReuseSpecError, plan_reuse

    job, columns, schema = _plan(tmp_path, **input_spec)
    with pytest.raises(ReuseSpecError, match=match) as err:
        plan_reuse(job, columns, schema, engine)
    assert err.value.permanent


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


# --- parse-time checks ----------------------------------------------------------------------------------


def test_jobspec_reuse_is_validated_when_the_dag_is_parsed():
    assert JobSpec(reuse="unchanged").reuse == "unchanged" and JobSpec().reuse is None
    with pytest.raises(SpecError, match="write JobSpec\\(reuse='unchanged'\\)"):
        JobSpec(reuse="always")
    assert JobSpec.from_dict(JobSpec(reuse="unchanged").to_dict()).reuse == "unchanged"


@pytest.mark.parametrize(
    ("output_spec", "input_spec", "match"),
    [
        (OutputSpec(stage_location="out/fixed"), InputSpec(), "give OutputSpec\\(base_stage_location=...\\)"),
        (OutputSpec(base_stage_location="out"), InputSpec(column_handling={"path": "bytes"}), "column_handling"),
    ],
)
def test_the_operator_refuses_reuse_where_it_cannot_work(output_spec, input_spec, match):
    from airflow_provider_batchinfer import BatchInferenceOperator

    with pytest.raises(SpecError, match=match):
        BatchInferenceOperator(
            task_id="infer",
            model="m",
            version="v1",
            input="in",
            input_spec=input_spec,
            output_spec=output_spec,
            job_spec=JobSpec(reuse="unchanged"),
        )


# --- the scenario on Ray --------------------------------------------------------------------------------

ROWS = 8_000
CHANGED = ROWS // 20  # every 20th text changed on day 2 (product_texts)
DELETED = range(1, ROWS * 3 // 4, 20)  # ids dropped on day 2
ADDED = ROWS // 40  # new ids on day 2
SCORED = CHANGED + ADDED  # the changed texts and the new rows
REUSED = ROWS - len(DELETED) - CHANGED  # the rest of day 2's rows


def _read(manifest: dict) -> pa.Table:
    from airflow_provider_batchinfer.store.committed import read_committed

    return read_committed(manifest).sort_by("product_id")


def _full_rescore(inputs: Path) -> pa.Table:
    """What scoring every row of ``inputs`` gives, computed in-process with the model itself: the
    passthrough columns, then the model's outputs, ids sorted."""
    table = pq.read_table(inputs).sort_by("product_id")
    out = TextFingerprint().predict(table.select(["text"]).to_pandas())
    return (
        table.select(["product_id", "price"])
        .append_column("length", pa.array(out["length"]))
        .append_column("crc", pa.array(out["crc"]))
    )


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, ray_cluster, airflow_db):
    """Runs on one base location: A (8k rows, nothing to reuse), B (5% changed, some deleted, some
    added), DAMAGED (A and B's key files damaged). A new model version and new params are checked
    without Ray: they change the context, which is all that decides what can be reused. A full
    re-score is computed in-process with the model itself. Returns {name: (xcom, manifest dict, rows
    scored by the model)}, "expected": day 2 fully re-scored, "intact": whether A's and B's key files
    matched their sha256 before they were damaged."""
    from airflow_provider_batchinfer import BatchInferenceOperator
    from airflow_provider_batchinfer.registry import ModelRegistry

    root = tmp_path_factory.mktemp("incremental")
    tally = root / "tally"
    tally.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHINFER_HOME", str(root / "home"))
        mp.setenv("RAY_ADDRESS", ray_cluster["address"])  # set up before any test's own RAY_ADDRESS
        registry = ModelRegistry(str(root / "home" / "registry"))
        registry.log_model("products", "v1", "python", python_class=TextFingerprint, signature=SIGNATURE)
        day1 = product_texts(ROWS)
        day2 = product_texts(ROWS, changed_every=20)  # CHANGED new texts
        for i in DELETED:
            del day2[i]
        for i in range(ROWS, ROWS + ADDED):
            day2[i] = f"new product {i}"
        inputs = {1: write_products(root / "day1", day1), 2: write_products(root / "day2", day2)}
        runs: dict = {"expected": _full_rescore(inputs[2])}

        def run(name, day):
            op = BatchInferenceOperator(
                task_id="embed",
                model="products",
                version="v1",
                input=str(inputs[day]),
                input_spec=InputSpec(id_column="product_id", params={"tally": str(tally)}),
                output_spec=OutputSpec(base_stage_location=str(root / "products"), mode=SaveMode.OVERWRITE),
                job_spec=JobSpec(reuse="unchanged", max_batch_rows=500, progress_interval_s=5),
            )
            ti = TaskInstanceStandIn(dag_id="bi_incremental", task_id="embed", run_id=f"scheduled__{name}")
            xcom = op.execute({"ti": ti})
            manifest = json.loads(Stage.open(xcom["manifest_location"]).read_bytes())
            runs[name] = (xcom, manifest, tallied(tally))
            return xcom

        run("A", 1)
        run("B", 2)
        # every key file committed like a part (size and sha256 as listed), before they are damaged
        runs["intact"] = {
            name: [
                hashlib.sha256(Path(runs[name][0]["output_location"], e["name"]).read_bytes()).hexdigest()
                == e["sha256"]
                for e in runs[name][1]["reuse"]["index"]
            ]
            for name in ("A", "B")
        }
        # damage the key files of every compatible earlier run, keeping their sizes: reuse falls back
        for name in ("A", "B"):
            for entry in runs[name][1]["reuse"]["index"]:
                path = Path(runs[name][0]["output_location"], entry["name"])
                path.write_bytes(b"\0" * path.stat().st_size)
        run("DAMAGED", 2)
        yield runs


def test_the_first_run_scores_everything_and_leaves_a_key_index(scenario):
    xcom, manifest, scored_by_model = scenario["A"]
    reuse = manifest["reuse"]
    assert (reuse["reused_rows"], reuse["scored_rows"], reuse["source_run"]) == (0, ROWS, None)
    assert scored_by_model == ROWS and xcom["scored_rows"] == ROWS and xcom["reused_rows"] == 0
    assert sum(e["rows"] for e in reuse["index"]) == ROWS  # one key per committed row
    assert {e["part"] for e in reuse["index"]} == {f["name"] for f in manifest["files"]}
    assert scenario["intact"]["A"] == [True] * len(reuse["index"]) and all(scenario["intact"]["B"])
    assert any("no earlier committed run" in n for n in reuse["notes"])


def test_the_second_run_copies_unchanged_rows_and_equals_a_full_rescore(scenario):
    xcom, manifest, scored_by_model = scenario["B"]
    reuse = manifest["reuse"]
    assert manifest["counts"]["input_rows"] == ROWS - len(DELETED) + ADDED
    # the changed texts and the new rows go to the model; the others are copied from run A
    assert (reuse["scored_rows"], reuse["reused_rows"]) == (SCORED, REUSED)
    assert scored_by_model == SCORED  # counted by the model itself
    assert reuse["source_run"] == scenario["A"][0]["output_location"] == xcom["reused_from"]
    assert (xcom["reused_rows"], xcom["scored_rows"]) == (REUSED, SCORED)
    incremental, full = _read(manifest), scenario["expected"]
    assert incremental.schema == full.schema and incremental.equals(full)  # no key column leaks
    assert _read(scenario["A"][1]).schema == full.schema  # as a run that scored every row writes it
    # the key match before Ray is timed (none without an earlier run); its keyed copies are gone
    assert manifest["timings"]["reuse_s"] > 0 and scenario["A"][1]["timings"]["reuse_s"] is None
    assert not list(Path(xcom["output_location"]).glob("_resume/**/*.parquet"))


def test_a_damaged_key_index_falls_back_to_scoring_every_row(scenario):
    _xcom, manifest, scored_by_model = scenario["DAMAGED"]
    reuse = manifest["reuse"]
    # B is the newest compatible run; its key files fail their sha256
    assert (reuse["reused_rows"], reuse["source_run"], scored_by_model) == (0, None, ROWS - len(DELETED) + ADDED)
    assert any(
        f"not reusing {scenario['B'][0]['output_location']}" in n and "does not match its sha256" in n
        for n in reuse["notes"]
    )
    assert _read(manifest).equals(scenario["expected"])


# --- an s3:// stage, through dag.test(), with a dead-lettered row ------------------------------------------


def _expected(texts: dict[int, str]) -> pa.Table:
    """What a full re-score gives, computed in-process with the model itself (ids sorted)."""
    import pandas as pd

    ids = sorted(texts)
    out = TextFingerprint().predict(pd.DataFrame({"text": [texts[i] for i in ids]}))
    return pa.table({"product_id": pa.array(ids, pa.int64()), "length": out["length"], "crc": out["crc"]})


def test_an_s3_stage_through_dag_test_reuses_and_dead_letters(
    airflow_db, ray_cluster, s3_server, s3_bucket, monkeypatch, tmp_path
):
    from airflow_provider_batchinfer import BatchInferenceOperator
    from airflow_provider_batchinfer.registry import ModelRegistry
    from airflow_provider_batchinfer.store.committed import read_committed, read_valid_manifest
    from tests.conftest import run_dag, xcom_value
    from tests.e2e.test_s3 import KEY_ID, SECRET, options

    storage = options(s3_server)
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCHINFER_DEFAULT",
        json.dumps(
            {
                "conn_type": "batchinfer",
                "login": KEY_ID,
                "password": SECRET,
                "extra": {
                    "endpoint_url": s3_server,
                    "region_name": "us-east-1",
                    "stage_root": f"s3://{s3_bucket}/stage",
                    "registry_root": f"s3://{s3_bucket}/registry",
                },
            }
        ),
    )
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(tmp_path / "model-cache"))
    ModelRegistry(f"s3://{s3_bucket}/registry", storage).log_model(
        "products", "v1", "python", python_class=TextFingerprint, signature=SIGNATURE
    )
    base = f"s3://{s3_bucket}/stage/products"
    day1 = product_texts(2_000)
    day2 = product_texts(2_000, changed_every=10)  # 200 new texts
    day2[5] = "boom"  # unchanged id, new text the model raises on: dead-lettered
    del day2[3], day2[7]
    day2.update({2_000: "new product a", 2_001: "new product b"})
    first = BatchInferenceOperator(
        task_id="embed",
        model="products",
        version="v1",
        input=str(write_products(tmp_path / "day1", day1)),
        input_spec=InputSpec(id_column="product_id"),
        output_spec=OutputSpec(base_stage_location=base, mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(reuse="unchanged", max_batch_rows=200, progress_interval_s=5),
    ).execute({"ti": TaskInstanceStandIn(dag_id="bi_test_incremental", task_id="embed", run_id="scheduled__day1")})
    assert first["scored_rows"] == 2_000 and first["output_location"] == f"{base}/scheduled__day1"

    state, tasks, run_id = run_dag("bi_test_incremental", input=str(write_products(tmp_path / "day2", day2)), base=base)
    assert state == "success", tasks
    xcom = xcom_value("bi_test_incremental", run_id, "embed")
    # 200 changed + 1 "boom" + 2 new rows scored (the boom row dead-lettered); 2,000 - 2 deleted - 201 copied
    assert (xcom["reused_rows"], xcom["scored_rows"], xcom["error_rows"]) == (1_797, 203, 1)
    assert xcom["reused_from"] == first["output_location"] and xcom["rows"] == 2_000 - 1
    manifest = read_valid_manifest(xcom["output_location"], storage, verify_checksums=True)
    assert manifest is not None and manifest.reuse is not None
    assert manifest.reuse.indexed_rows == manifest.counts.output_rows  # dead-lettered rows get no key
    present = dict(Stage.open(xcom["output_location"], storage).list_files())
    assert all(present[e.name] == e.size for e in manifest.reuse.index)
    del day2[5]
    got = read_committed(manifest, storage).select(["product_id", "length", "crc"]).sort_by("product_id")
    assert got.equals(_expected(day2))
