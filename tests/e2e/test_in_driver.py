"""On the embedded Ray, one-replica CPU jobs and small jobs are scored in the driver process
(runtime/engine/in_driver.py), reading, scoring and writing on three threads (runtime/engine/in_driver_io.py).

The fast tests drive the runtime's ``run`` in this process with Ray refused outright: the in-driver
path must never start or attach to Ray. The slow one runs the same input through the operator on a
real embedded Ray both ways and compares the committed outputs row for row."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, placement
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, SpecError
from airflow_provider_batchinfer.runtime.engine import in_driver
from airflow_provider_batchinfer.runtime.errors import JobError, ModelBatchError
from tests.e2e.test_embedded_ray import _starts, ray_dir  # noqa: F401  (ray_dir: a fixture, this test's own embedded Ray)
from tests.models import committed_manifest, job_file, write_job_file, write_tickets


# --- the setting ----------------------------------------------------------------------------------
def test_the_limit_comes_from_the_job_then_the_deployment_then_1000():
    assert in_driver.max_rows(None, {}) == 1000
    assert in_driver.max_rows(None, {in_driver.MAX_ROWS_ENV: "50"}) == 50
    assert in_driver.max_rows(0, {in_driver.MAX_ROWS_ENV: "50"}) == 0  # the job's own value wins
    assert in_driver.max_rows(5000, {}) == 5000
    for bad in ("lots", "-3", "1.5"):
        with pytest.raises(in_driver.InDriverSettingError, match=rf"BATCHINFER_IN_DRIVER_MAX_ROWS='{bad}' is not a"):
            in_driver.max_rows(None, {in_driver.MAX_ROWS_ENV: bad})
    assert in_driver.InDriverSettingError.permanent


def test_jobspec_takes_a_whole_number_of_rows_or_none():
    assert JobSpec.from_dict(JobSpec(in_driver_max_rows=0).to_dict()).in_driver_max_rows == 0
    assert JobSpec().in_driver_max_rows is None
    for bad in (-1, True, 2.5, "100"):
        with pytest.raises(SpecError, match=r"JobSpec.in_driver_max_rows is the most rows .* got"):
            JobSpec(in_driver_max_rows=bad)


def _checked(rows=100, flavor="python_class", llm_engine=None, kept_ids=(), **spec):
    return SimpleNamespace(
        job=SimpleNamespace(job_spec=JobSpec(**spec), model=SimpleNamespace(flavor=flavor), llm_engine=llm_engine),
        todo_rows=rows,
        kept={"ids": list(kept_ids)},
    )


def test_one_replica_and_small_cpu_jobs_on_the_embedded_ray_are_scored_in_the_driver():
    embedded = {in_driver.EMBEDDED_ENV: "1"}
    scored_here = [
        _checked(),
        _checked(rows=1000, replicas=4),  # small: the pool's start-up would be most of its time
        _checked(rows=10_000_000),  # one replica: the pool would run it in another process here
        _checked(rows=5000, kept_ids=[1, 2], rows_per_part=10),  # RESUME and rows_per_part work here too
        _checked(rows=0),  # RESUME found every row done: nothing to score needs no Ray
        _checked(rows=0, replicas=4),
        _checked(flavor="text_generation"),  # the transformers engine on CPU
    ]
    for checked in scored_here:
        assert in_driver.why_not(checked, embedded) is None
    assert "at most in_driver_max_rows=1,000 rows" in in_driver.why_here(_checked(rows=1000, replicas=4), embedded)
    assert "one CPU replica" in in_driver.why_here(_checked(rows=10_000_000), embedded)
    cases = [
        (_checked(), {}, "not on the embedded Ray"),  # another cluster: its nodes do the work
        (
            _checked(rows=1001, replicas=2),
            embedded,
            "replicas=2 and 1,001 rows to score, more than in_driver_max_rows=1,000",
        ),
        (_checked(in_driver_max_rows=0), embedded, "in_driver_max_rows=0"),
        (_checked(), {**embedded, in_driver.MAX_ROWS_ENV: "0"}, "in_driver_max_rows=0"),
        (_checked(num_gpus=1), embedded, "GPU replicas"),
        (_checked(flavor="text_generation", llm_engine="vllm"), embedded, "the vLLM engine"),
        (_checked(reuse="unchanged"), embedded, "incremental reuse"),
        (_checked(max_cost=1.0), embedded, "a budget guard"),
    ]
    for checked, env, why in cases:
        assert why in (in_driver.why_not(checked, env) or ""), why
    assert in_driver.why_not(_checked(rows=50, replicas=2, in_driver_max_rows=10), embedded) is not None


def test_the_launcher_leaves_ray_unstarted_only_for_jobs_the_runtime_scores_in_its_driver():
    """``placement.scored_in_driver_whatever_the_rows`` is what the local launcher reads before the
    runtime exists (no Ray started for such a job): whenever it says yes, the runtime's own rule must
    score the job in its driver for every row count, or the job would need a Ray nobody started."""
    embedded = {in_driver.EMBEDDED_ENV: "1"}
    specs = [
        {},
        {"replicas": 2},
        {"in_driver_max_rows": 0},
        {"in_driver_max_rows": 10},
        {"num_gpus": 1},
        {"reuse": "unchanged"},
        {"max_cost": 1.0},
        {"max_output_tokens_total": 100},
    ]
    jobs = [
        (spec, flavor, engine)
        for spec in specs
        for flavor in ("python_class", "text_generation")
        for engine in (None, "vllm", "transformers")
    ]
    envs = [embedded, {}, {**embedded, in_driver.MAX_ROWS_ENV: "0"}, {**embedded, in_driver.MAX_ROWS_ENV: "5"}]
    yes = 0
    for spec, flavor, engine in jobs:
        for env in envs:
            job = _checked(flavor=flavor, llm_engine=engine, **spec).job
            if not placement.scored_in_driver_whatever_the_rows(job, env):
                continue
            yes += 1
            for rows in (0, 1, 1000, 1001, 10_000_000):
                checked = _checked(rows=rows, flavor=flavor, llm_engine=engine, **spec)
                assert in_driver.why_not(checked, env) is None, (spec, flavor, engine, env, rows)
    # one replica, CPU, no reuse or budget, not vLLM, a limit above 0 (the job's own wins over the
    # deployment's 0), on the embedded default: 2 specs x 5 model kinds, in 2 and 3 environments
    assert yes == 25
    one_replica = _checked().job
    assert placement.scored_in_driver_whatever_the_rows(one_replica, embedded)
    assert not placement.scored_in_driver_whatever_the_rows(one_replica, {})  # a named cluster does the work
    assert not placement.scored_in_driver_whatever_the_rows(one_replica, {**embedded, in_driver.MAX_ROWS_ENV: "x"})
    assert not placement.scored_in_driver_whatever_the_rows(_checked(replicas=2).job, embedded)


def test_the_driver_reads_one_row_group_at_a_time_in_batches_of_at_most_16384_rows(tmp_path):
    """The driver's memory is the batches in flight: their size must not follow the input's layout.
    The pool's batch (65,536 rows here) is cut to 16,384 rows (65,536 for a model that takes
    concurrent one-thread calls), and a batch never spans two row groups, since each row group is
    read (and pre-buffered) on its own."""
    import numpy as np
    import pyarrow as pa

    from airflow_provider_batchinfer.runtime.engine.in_driver_io import Pipe, driver_batch_rows, read_batches

    path = tmp_path / "in.parquet"
    ids = np.arange(60_000, dtype=np.int64)
    pq.write_table(pa.table({"ticket_id": ids, "x": ids * 2.0, "unread": ids}), path, row_group_size=20_000)
    checked = SimpleNamespace(
        read_files=[str(path)],
        read_groups=[[20_000] * 3],
        storage=None,
        batch_rows=65_536,
        plan={"read": ["ticket_id", "x"]},
        job=SimpleNamespace(input_spec=InputSpec(id_column="ticket_id")),
    )
    assert driver_batch_rows(checked) == 16_384 and driver_batch_rows(checked, concurrent_calls=True) == 65_536
    assert driver_batch_rows(SimpleNamespace(batch_rows=1_000), concurrent_calls=True) == 1_000  # the plan's, if less
    pipe = Pipe(size=100)
    read_batches(checked, pipe, driver_batch_rows(checked))
    batches = list(pipe)
    assert [t.num_rows for _, t in batches] == [16_384, 3_616] * 3
    assert {i for i, _ in batches} == {0} and all(t.column_names == ["ticket_id", "x"] for _, t in batches)
    assert pa.concat_tables([t for _, t in batches])["ticket_id"].to_numpy().tolist() == ids.tolist()


# --- the runtime, with Ray refused ----------------------------------------------------------------
@pytest.fixture
def in_driver_job(monkeypatch, text_length_model, registry, tmp_path):
    """``spec(inputs, **job)``: a job file for the runtime, run as the embedded Ray's driver would be."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started, but a small job on the embedded Ray is scored in the driver")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setenv(in_driver.EMBEDDED_ENV, "1")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens there: attaching would fail

    def spec(inputs, attempt="t01test", resume=False, **job):
        run_dir = tmp_path / "out"
        run_dir.mkdir(exist_ok=True)
        job_spec = JobSpec(**{"max_batch_rows": 40, **job})
        return run_dir, write_job_file(
            job_file(
                run_dir,
                text_length_model,
                registry.root,
                [str(inputs)],
                input_spec=InputSpec(id_column="ticket_id"),
                job_spec=job_spec,
                attempt=attempt,
                resume=resume,
            )
        )

    return spec


def test_a_small_job_is_scored_in_the_driver_and_committed_as_the_pool_would(in_driver_job, tmp_path, capsys):
    from airflow_provider_batchinfer.runtime.driver import run

    data = write_tickets(tmp_path / "in", rows=300, files=3)
    run_dir, spec = in_driver_job(data)
    manifest = run(spec)
    assert "scoring 300 rows in the driver process, no actor pool" in capsys.readouterr().out
    assert manifest.job.pool.in_driver and [n.node_id for n in manifest.job.pool.nodes] == ["driver"]
    assert manifest.counts.output_rows == 300 and manifest.counts.error_rows == 0
    # a part per input file, named as Ray's write tasks name theirs
    assert [f.name for f in manifest.files] == [f"part-0000{i}-t01test.parquet" for i in range(3)]
    assert [f.rows for f in manifest.files] == [100, 100, 100]
    assert manifest.usage.batches == 9 and manifest.usage.rows == 300  # 3 x 100 rows in model calls of 40
    # done within one progress interval: the steady rate comes from the counter's own batch reports
    assert manifest.timings["steady_rows_per_s"] > 0
    committed = committed_manifest(str(run_dir))  # re-read: every part's size and sha256 check out
    assert committed is not None and committed["job"]["pool"]["in_driver"] is True
    out = pq.read_table([str(run_dir / f.name) for f in manifest.files]).sort_by("ticket_id")
    source = pq.read_table(data).sort_by("ticket_id")
    assert out.column_names == ["ticket_id", "length"]
    assert out["ticket_id"].to_pylist() == list(range(300))
    assert out["length"].to_pylist() == [len(t) for t in source["text"].to_pylist()]


def test_a_large_one_replica_job_streams_into_parts_of_rows_per_part(in_driver_job, tmp_path, capsys):
    """Past in_driver_max_rows a one-replica job stays in the driver, and rows_per_part cuts its
    parts across batch boundaries (RESUME's unit) without losing or repeating a row."""
    from airflow_provider_batchinfer.runtime.driver import run

    data = write_tickets(tmp_path / "in", rows=2500, files=2)
    run_dir, spec = in_driver_job(data, rows_per_part=700, in_driver_max_rows=100)
    manifest = run(spec)
    assert "(one CPU replica on the embedded Ray" in capsys.readouterr().out
    assert manifest.job.pool.in_driver and manifest.counts.output_rows == 2500
    # 1,250 rows per file: 700 + 550 in each (a new part at each input file)
    assert [f.rows for f in manifest.files] == [700, 550, 700, 550]
    assert committed_manifest(str(run_dir)) is not None
    out = pq.read_table([str(run_dir / f.name) for f in manifest.files])
    assert sorted(out["ticket_id"].to_pylist()) == list(range(2500))


def test_a_model_error_in_the_driver_commits_nothing_and_keeps_the_rows_scored_before_it(in_driver_job, tmp_path):
    """The first file's rows were scored before the bad one: they are a whole part (what the pool's
    finished write tasks leave), and a RESUME attempt keeps them and scores only the rest."""
    from airflow_provider_batchinfer.runtime.driver import run

    data = write_tickets(tmp_path / "in", rows=200, files=2, bad_row=123)
    run_dir, spec = in_driver_job(data)
    with pytest.raises(ModelBatchError, match=r"ValueError: cannot score text 'boom' .* with ticket_id (\d+)\.\.(\d+)"):
        run(spec)
    assert sorted(p.name for p in run_dir.iterdir() if p.name != "_claims") == [
        JOB_SPEC_FILE,
        "part-00000-t01test.parquet",
    ]  # no marker
    assert pq.read_table(run_dir / "part-00000-t01test.parquet")["ticket_id"].to_pylist() == list(range(100))

    _, resumed = in_driver_job(data, attempt="t02test", resume=True, on_error="dead_letter", max_error_fraction=0.05)
    manifest = run(resumed)
    assert manifest.counts.output_rows == 199 and manifest.counts.error_rows == 1
    assert manifest.resume_s is not None and manifest.resume_s > 0  # finding the 100 rows left
    assert [f.name for f in manifest.files] == ["part-00000-t01test.parquet", "part-00000-t02test.parquet"]
    out = pq.read_table([str(run_dir / f.name) for f in manifest.files])
    assert sorted(out["ticket_id"].to_pylist()) == [i for i in range(200) if i != 123]


def test_a_resume_with_every_row_already_written_commits_in_the_driver_without_ray(in_driver_job, tmp_path, capsys):
    """Too many dead-lettered rows fail the first attempt after every part was written; its RESUME
    has 0 rows left to score. That is decided in the driver (no Ray for nothing to do): the kept
    parts are committed as they are."""
    from airflow_provider_batchinfer.runtime.driver import run

    data = write_tickets(tmp_path / "in", rows=200, files=2, bad_row=123)
    run_dir, spec = in_driver_job(data, on_error="dead_letter", max_error_fraction=0.0)
    with pytest.raises(JobError, match=r"1 of 200 rows \(0.50%\) could not be scored, above JobSpec"):
        run(spec)
    assert not (run_dir / SUCCESS_MARKER).exists()
    written = sorted(p.name for p in run_dir.glob("part-*.parquet"))
    _, resumed = in_driver_job(data, attempt="t02test", resume=True, on_error="dead_letter", max_error_fraction=0.05)
    manifest = run(resumed)
    assert "scoring 0 rows in the driver process" in capsys.readouterr().out
    assert (manifest.counts.output_rows, manifest.counts.error_rows) == (199, 1)
    assert sorted(f.name for f in manifest.files) == written  # the first attempt's parts, nothing new
    out = pq.read_table([str(run_dir / f.name) for f in manifest.files])
    assert sorted(out["ticket_id"].to_pylist()) == [i for i in range(200) if i != 123]


def test_dead_letter_in_the_driver_commits_the_rest_with_the_bad_row_apart(in_driver_job, tmp_path):
    from airflow_provider_batchinfer.runtime.driver import run

    data = write_tickets(tmp_path / "in", rows=200, files=2, bad_row=123)
    run_dir, spec = in_driver_job(data, on_error="dead_letter", max_error_fraction=0.05)
    manifest = run(spec)
    assert (manifest.counts.output_rows, manifest.counts.error_rows) == (199, 1)
    # the bad row is in the second input file: its dead-letter file has the second part's number
    assert [f.name for f in manifest.error_files] == ["_errors/part-00001-t01test.parquet"]
    errors = pq.read_table(run_dir / manifest.error_files[0].name).to_pylist()
    assert [e["ticket_id"] for e in errors] == [123] and "cannot score text 'boom'" in errors[0]["error"]
    assert (run_dir / SUCCESS_MARKER).exists()


@pytest.mark.parametrize("side", ["read", "write"])
def test_a_failing_read_or_write_fails_the_job_with_its_own_error_and_commits_nothing(
    in_driver_job, tmp_path, monkeypatch, side
):
    """The reader's or the writer's thread fails on the second input file: the job raises that
    error (no hang on a full queue), and nothing is committed."""
    from airflow_provider_batchinfer.runtime.driver import run
    from airflow_provider_batchinfer.runtime.engine import in_driver_io

    data = write_tickets(tmp_path / "in", rows=2000, files=2)
    run_dir, spec = in_driver_job(data, max_batch_rows=10)
    if side == "read":
        real = in_driver_io.row_group_batches  # the reader thread's read, after the checks read the footers

        def read_row_groups(location, *args, **kwargs):
            if str(location).endswith("tickets-01.parquet"):
                raise OSError(f"disk gone while reading {location}")
            return real(location, *args, **kwargs)

        monkeypatch.setattr(in_driver_io, "row_group_batches", read_row_groups)
    else:
        real_write = in_driver_io.PartRoller._write_rows

        def write_rows(self, table):
            if self._number == 1:
                raise OSError("disk full while writing part 1")
            real_write(self, table)

        monkeypatch.setattr(in_driver_io.PartRoller, "_write_rows", write_rows)
    with pytest.raises(OSError, match="disk gone while reading" if side == "read" else "disk full while writing"):
        run(spec)
    assert not (run_dir / SUCCESS_MARKER).exists()


def test_a_pipe_wakes_its_reader_and_its_writer_when_the_other_side_aborts():
    import threading

    from airflow_provider_batchinfer.runtime.engine.in_driver_io import Aborted, Pipe

    pipe = Pipe(size=1)
    pipe.put("first")
    outcome = []

    def blocked_put():
        try:
            pipe.put("second")  # the queue is full: waits until the pipe is aborted
        except Aborted:
            outcome.append("aborted")

    putter = threading.Thread(target=blocked_put)
    putter.start()
    pipe.aborted.set()
    putter.join(timeout=5)
    assert outcome == ["aborted"] and not putter.is_alive()
    full = Pipe(size=1)
    full.put("a batch")  # a full queue must not swallow the reading side's error (nor hang the model's thread)
    full.fail(ValueError("the reader's own error"))
    with pytest.raises(ValueError, match="the reader's own error"):
        full.get()
    with pytest.raises(Aborted):
        nothing = Pipe(size=1)
        nothing.aborted.set()
        nothing.get()


def test_a_bad_deployment_setting_fails_before_any_scoring(in_driver_job, tmp_path, monkeypatch):
    from airflow_provider_batchinfer.runtime.driver import run

    monkeypatch.setenv(in_driver.MAX_ROWS_ENV, "many")
    run_dir, spec = in_driver_job(write_tickets(tmp_path / "in", rows=20, files=1))
    with pytest.raises(in_driver.InDriverSettingError, match=r"write e.g. BATCHINFER_IN_DRIVER_MAX_ROWS=1000"):
        run(spec)
    assert sorted(p.name for p in run_dir.iterdir() if p.name != "_claims") == [JOB_SPEC_FILE]


def test_concurrent_calls_come_back_in_order_and_an_error_drops_only_what_follows():
    """Two calls at a time finish out of order (the first batch is the slowest): the batches still
    come back in their order. A call that raised raises in its turn, after every batch before it;
    no batch after it comes back, and those not yet started never start."""
    import threading
    import time

    started: list[int] = []
    lock = threading.Lock()

    def score(n: int) -> int:
        with lock:
            started.append(n)
        time.sleep(0.05 if n % 3 == 0 else 0.001)
        if n == 7:
            raise ValueError("batch 7 is bad")
        return n * 10

    batches = [(n // 4, n) for n in range(40)]  # (file index, batch)
    assert list(in_driver.scored_in_order(score, batches[:7], workers=2)) == [(n // 4, n * 10) for n in range(7)]
    started.clear()
    got = []
    with pytest.raises(ValueError, match="batch 7 is bad"):
        for item in in_driver.scored_in_order(score, iter(batches), workers=2):
            got.append(item)
    assert got == [(n // 4, n * 10) for n in range(7)]
    assert max(started) <= 7 + 2  # at most the calls running and the one waiting when 7's turn came
    started.clear()
    assert list(in_driver.scored_in_order(score, batches[:3], workers=1)) == [(0, 0), (0, 10), (0, 20)]


@pytest.fixture
def xgboost_job(monkeypatch, registry, tmp_path):
    """A numeric XGBoost model and its input, two files of 25,000 rows (row groups of 20,000 + 5,000,
    ``f2`` null every 13th row), run as the embedded Ray's driver would: ``(booster, x, nulls, spec)``
    where ``spec(attempt, resume)`` writes a job file into ``tmp_path / "out"``."""
    import numpy as np
    import pyarrow as pa
    import ray
    import xgboost as xgb

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("the job started Ray"))
    monkeypatch.setenv(in_driver.EMBEDDED_ENV, "1")
    rng = np.random.default_rng(3)
    rows, names = 50_000, ["f0", "f1", "f2", "f3"]
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    booster = xgb.train({"max_depth": 5, "nthread": 1}, xgb.DMatrix(x, label=x[:, 0] + x[:, 1] > 0), 15)
    mv = registry.log_model("numeric_xgb", "v1", "xgboost", booster, feature_names=names)
    nulls = np.zeros(rows, dtype=bool)
    nulls[::13] = True
    columns = {"id": pa.array(np.arange(rows))}
    columns.update({n: pa.array(x[:, i], mask=nulls if n == "f2" else None) for i, n in enumerate(names)})
    table = pa.table(columns)
    inputs = tmp_path / "in"
    inputs.mkdir()
    for part, start in enumerate(range(0, rows, 25_000)):
        pq.write_table(table.slice(start, 25_000), inputs / f"rows-{part}.parquet", row_group_size=20_000)
    run_dir = tmp_path / "out"
    run_dir.mkdir()

    def spec(attempt: str = "t01test", resume: bool = False) -> str:
        job = job_file(
            run_dir,
            mv,
            registry.root,
            [str(inputs)],
            input_spec=InputSpec(id_column="id"),
            attempt=attempt,
            resume=resume,
        )
        return write_job_file(job)

    return booster, x, nulls, spec


def test_an_xgboost_job_in_the_driver_scores_from_two_threads_exactly_as_inplace_predict(xgboost_job, tmp_path, capsys):
    """XGBoost takes concurrent calls: the driver loads it with one thread and calls it from the
    job's two threads, each call on a whole batch (nulls as missing). The rows come back in
    their input order and bit for bit as the booster's own ``inplace_predict`` on the float matrix."""
    import numpy as np

    from airflow_provider_batchinfer.runtime.driver import run

    booster, x, nulls, spec = xgboost_job
    manifest = run(spec())
    printed = capsys.readouterr().out
    # batches of up to 65,536 rows (here the plan's 25,000: a file), each scored in one call
    assert "2 one-thread model calls at a time, batches of 25,000 rows, model calls of at most 25,000 rows" in printed
    assert manifest.counts.output_rows == len(x) and manifest.usage.batches == 4  # per file: 20,000 + 5,000
    run_dir = tmp_path / "out"
    out = pq.read_table([str(run_dir / f.name) for f in manifest.files])
    assert out["id"].to_pylist() == list(range(len(x)))  # in order, though two calls ran at a time
    x[nulls, 2] = np.nan
    np.testing.assert_array_equal(out["prediction"].to_numpy(), booster.inplace_predict(x))


def test_a_failing_concurrent_call_commits_nothing_and_keeps_the_batches_before_it(xgboost_job, tmp_path, monkeypatch):
    """The call on the second file's first batch fails while another call runs beside it: the job
    raises the model's error, writes no ``_SUCCESS``, and the batches before it in input order (the
    first file) are one whole part that a RESUME attempt keeps, scoring only the second file."""
    import xgboost as xgb

    from airflow_provider_batchinfer.runtime.driver import run

    _, x, _, spec = xgboost_job
    real = xgb.Booster.inplace_predict

    def failing_on_the_second_file(self, data, *args, **kwargs):
        if data.shape[0] == 20_000 and data[0, 0] == x[25_000, 0]:
            raise ValueError("injected: the second file's first batch")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(xgb.Booster, "inplace_predict", failing_on_the_second_file)
    with pytest.raises(ModelBatchError, match=r"ValueError: injected: the second file's first batch"):
        run(spec())
    run_dir = tmp_path / "out"
    assert sorted(p.name for p in run_dir.iterdir() if p.name != "_claims") == [
        JOB_SPEC_FILE,
        "part-00000-t01test.parquet",
    ]  # no marker
    assert pq.read_table(run_dir / "part-00000-t01test.parquet")["id"].to_pylist() == list(range(25_000))

    monkeypatch.setattr(xgb.Booster, "inplace_predict", real)
    manifest = run(spec("t02test", resume=True))
    assert manifest.counts.output_rows == len(x) and (run_dir / SUCCESS_MARKER).exists()
    assert [f.name for f in manifest.files] == ["part-00000-t01test.parquet", "part-00000-t02test.parquet"]
    out = pq.read_table([str(run_dir / f.name) for f in manifest.files])
    assert out["id"].to_pylist() == list(range(len(x)))


# --- end to end on a real embedded Ray ----------------------------------------------------------------
@pytest.mark.usefixtures("airflow_db")
def test_on_the_embedded_ray_the_driver_and_the_pool_commit_the_same_rows(
    ray_dir,  # noqa: F811
    text_length_model,
    tmp_path,
):
    """The driver's run starts no Ray at all (the launcher knows a one-replica job needs none); the
    pool's run starts the embedded Ray; both commit the same rows. Each run is the operator's
    execute, as a worker's task process runs it."""
    from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec, SaveMode
    from airflow_provider_batchinfer.launchers.embedded import embedded_ray
    from tests.task_context import TaskInstanceStandIn

    data = write_tickets(tmp_path / "in", rows=400, files=2)
    manifests, tables, ray_states = {}, {}, {}
    for name, job_spec in (  # the default, then always on the actor pool
        ("driver", JobSpec(max_batch_rows=100, progress_interval_s=2)),
        ("pool", JobSpec(max_batch_rows=100, progress_interval_s=2, in_driver_max_rows=0)),
    ):
        out = tmp_path / name
        BatchInferenceOperator(
            task_id="infer",
            model="text_length",
            version="v1",
            input=str(data),
            output_spec=OutputSpec(stage_location=str(out), mode=SaveMode.ERROR),
            job_spec=job_spec,
        ).execute({"ti": TaskInstanceStandIn(run_id=f"manual__{name}")})
        manifests[name] = committed_manifest(str(out))
        tables[name] = pq.read_table([str(out / f["name"]) for f in manifests[name]["files"]])
        ray_states[name] = (embedded_ray.read_state(ray_dir), len(_starts(ray_dir)))
    assert ray_states["driver"] == (None, 0)  # never started
    assert ray_states["pool"][0] is not None and ray_states["pool"][1] == 1
    in_driver_run, pool_run = manifests["driver"], manifests["pool"]
    assert in_driver_run["job"]["pool"]["in_driver"] is True and pool_run["job"]["pool"]["in_driver"] is False
    assert pool_run["job"]["pool"]["nodes"][0]["node_id"] != "driver"
    assert in_driver_run["counts"] == pool_run["counts"] == {"input_rows": 400, "output_rows": 400, "error_rows": 0}
    ours, theirs = (tables[name].sort_by("ticket_id") for name in ("driver", "pool"))
    assert ours.schema == theirs.schema and ours.equals(theirs)
