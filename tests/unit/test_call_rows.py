"""``JobSpec.max_batch_rows`` has one meaning: the most rows of one model call, exactly. Unset, the
model kind decides (``flavors.call_rows``). Checked through the real path: the driver's checks
resolve it once, and a replica built from the driver's arguments calls a real model with it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract.specs import JobSpec, SpecError
from airflow_provider_batchinfer.runtime.model.flavors import call_rows
from airflow_provider_batchinfer.runtime.model.flavors.tabular.tabular_inputs import chunked
from airflow_provider_batchinfer.runtime.tuning import TUNING, Tuning

ROWS = 5000


@pytest.mark.parametrize("value", [0, -3, True, "x", 2.5])
def test_max_batch_rows_is_a_whole_number_of_at_least_one_or_none(value: Any) -> None:
    with pytest.raises(SpecError, match=r"JobSpec.max_batch_rows must be a whole number >= 1 or None .*got"):
        JobSpec(max_batch_rows=value)
    assert JobSpec().max_batch_rows is None and JobSpec(max_batch_rows=1).max_batch_rows == 1


def test_unset_the_kind_decides_and_set_it_is_exact_on_every_device() -> None:
    assert Tuning() == TUNING and TUNING.call_rows == 256
    unset = {
        name: call_rows(name, "cpu", None)
        for name in ("torchscript", "sklearn", "xgboost", "lightgbm", "sentence_transformers", "python", "onnx")
    }
    assert unset == {
        "torchscript": 4096,
        "sklearn": 16384,
        "xgboost": 16384,
        "lightgbm": 16384,
        "sentence_transformers": 32,
        "python": TUNING.call_rows,
        "onnx": TUNING.call_rows,
    }
    for name in unset:
        assert call_rows(name, "cuda", None) == TUNING.call_rows, name
        assert call_rows(name, "cpu", 100) == call_rows(name, "cuda", 100) == 100, name


@pytest.mark.parametrize(("max_batch_rows", "largest_call"), [(100, 100), (None, 16384)])
def test_a_scikit_learn_model_on_cpu_is_called_with_the_resolved_rows(max_batch_rows, largest_call) -> None:
    # the tabular flavors (sklearn, xgboost, lightgbm) cut their batch with ``chunked``
    calls: list[int] = []

    def score(x: np.ndarray) -> dict[str, np.ndarray]:
        calls.append(len(x))
        return {"prediction": x[:, 0]}

    x = np.arange(2 * 65536, dtype=np.float64).reshape(-1, 2)
    out = chunked(score, x, len(x), call_rows("sklearn", "cpu", max_batch_rows))
    assert max(calls) == largest_call and sum(calls) == len(x) == len(out["prediction"])


@pytest.fixture
def rows_in_call_model(registry):
    """A real TorchScript model whose output is the number of rows of the call that scored it."""
    import torch

    class RowsInCall(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.full((x.shape[0], 1), float(x.shape[0])) + 0 * x[:, :1]

    return registry.log_model(
        "rows_in_call",
        "v1",
        "torchscript",
        artifact=torch.jit.script(RowsInCall()),
        signature={"inputs": {"a": "float32", "b": "float32"}, "outputs": {"rows_in_call": "float32"}},
    )


def _replica_calls(tmp_path, registry, model, monkeypatch, job_spec: JobSpec) -> tuple[int, list[float]]:
    """The driver's resolved rows per call, and the call sizes a replica built from the driver's
    arguments used on one batch of ``ROWS`` rows on CPU."""
    import torch

    from airflow_provider_batchinfer.runtime.driver import check_before_ray
    from airflow_provider_batchinfer.runtime.engine.pool_dataset import replica_kwargs
    from airflow_provider_batchinfer.runtime.model.replica import ModelReplica
    from tests.models import job_file

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the replica sets them for its threads
        monkeypatch.setenv(name, "1")
    threads = torch.get_num_threads()
    inputs = tmp_path / "in"
    inputs.mkdir()
    table = pa.table({"id": np.arange(ROWS), "a": np.ones(ROWS, np.float32), "b": np.arange(ROWS, dtype=np.float32)})
    pq.write_table(table, inputs / "part-0.parquet")
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    checked = check_before_ray(job_file(run_dir, model, registry.root, [inputs], job_spec=job_spec))
    pool: Any = {"device": "cpu", "threads": 1, "num_gpus": 0.0}
    try:
        replica = ModelReplica(**replica_kwargs(checked, pool, None))
        out = replica(table)
    finally:
        torch.set_num_threads(threads)
    assert out.num_rows == ROWS
    return checked.call_rows, sorted(set(out.column("rows_in_call").to_pylist()))


def test_a_torchscript_job_that_sets_max_batch_rows_calls_the_model_with_at_most_that_many_rows(
    tmp_path, registry, rows_in_call_model, monkeypatch
) -> None:
    # before, a CPU job's 100 was raised to the kind's 4,096 rows per call
    resolved, sizes = _replica_calls(tmp_path, registry, rows_in_call_model, monkeypatch, JobSpec(max_batch_rows=100))
    assert resolved == 100 and sizes == [100.0]


def test_a_torchscript_job_that_leaves_it_unset_gets_the_kinds_cpu_calls(
    tmp_path, registry, rows_in_call_model, monkeypatch
) -> None:
    resolved, sizes = _replica_calls(tmp_path, registry, rows_in_call_model, monkeypatch, JobSpec())
    assert resolved == 4096 and sizes == [float(ROWS - 4096), 4096.0]


def _checked(flavor: str, max_batch_rows: int | None, backend: str | None = None) -> Any:
    spec = JobSpec(max_batch_rows=max_batch_rows, backend=backend)
    return SimpleNamespace(job=SimpleNamespace(job_spec=spec, model=SimpleNamespace(flavor=flavor)))


def test_the_driver_gives_concurrent_calls_their_whole_batch_only_when_the_job_leaves_the_rows_unset() -> None:
    from airflow_provider_batchinfer.runtime.engine.in_driver import whole_batch_calls

    assert whole_batch_calls(_checked("xgboost", None), workers=2)
    assert not whole_batch_calls(_checked("xgboost", 100), workers=2)  # the job's 100 rows hold
    assert not whole_batch_calls(_checked("xgboost", None), workers=1)
    assert not whole_batch_calls(_checked("sklearn", None), workers=2)  # no concurrent calls
    # the ONNX Runtime text encoder takes concurrent calls but keeps encode's calls inside its batch
    assert not whole_batch_calls(_checked("sentence_transformers", None, backend="onnx"), workers=2)


def test_vllms_batch_size_is_the_jobs_rows_per_call(tmp_path) -> None:
    from airflow_provider_batchinfer.runtime.model import llm

    def batch_size(spec: JobSpec) -> int:
        return llm.processor_config(tmp_path, spec, multimodal=False)["batch_size"]

    assert batch_size(JobSpec(num_gpus=1)) == TUNING.call_rows
    assert batch_size(JobSpec(num_gpus=1, max_batch_rows=8)) == 8


def test_the_kinds_own_rows_per_call_parameter_counts_when_max_batch_rows_is_unset():
    """sentence-transformers' ``batch_size`` param is its rows per call, as before ``max_batch_rows``
    had one meaning; ``max_batch_rows`` set wins, and other kinds ignore the param."""
    assert call_rows("sentence_transformers", "cpu", None, {"batch_size": 64}) == 64
    assert call_rows("sentence_transformers", "cuda", None, {"batch_size": 512}) == 512
    assert call_rows("sentence_transformers", "cpu", 16, {"batch_size": 64}) == 16
    assert call_rows("sentence_transformers", "cpu", None, {}) == 32
    assert call_rows("torchscript", "cpu", None, {"batch_size": 64}) == 4096


class _Reports:
    """Stands in for the usage board: each report a replica sends, by method name."""

    def __init__(self) -> None:
        self.sent: dict[str, list[tuple]] = {}

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=lambda *args: self.sent.setdefault(name, []).append(args))


def test_a_replica_that_reads_its_own_blocks_scores_them_in_the_jobs_batches(
    tmp_path, registry, rows_in_call_model, monkeypatch
) -> None:
    """A read fused into the replica hands it each read task's block whole; it still scores and
    reports batches of at most the job's batch rows, and gives back every row in order."""
    import torch

    from airflow_provider_batchinfer.runtime.driver import check_before_ray
    from airflow_provider_batchinfer.runtime.engine.pool_dataset import replica_kwargs
    from airflow_provider_batchinfer.runtime.model.usage import MeteredReplica
    from tests.models import job_file

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    threads = torch.get_num_threads()
    table = pa.table({"id": np.arange(ROWS), "a": np.ones(ROWS, np.float32), "b": np.arange(ROWS, dtype=np.float32)})
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "part-0.parquet")
    (tmp_path / "out").mkdir()
    checked = check_before_ray(job_file(tmp_path / "out", rows_in_call_model, registry.root, [tmp_path / "in"]))
    pool: Any = {"device": "cpu", "threads": 1, "num_gpus": 0.0}
    reports = _Reports()
    try:
        replica = MeteredReplica(**replica_kwargs(checked, pool, reports), slice_rows=3_000)
        out = replica(table)
    finally:
        torch.set_num_threads(threads)
    assert out.column("id").to_pylist() == list(range(ROWS))
    assert max(out.column("rows_in_call").to_pylist()) <= 3_000
    assert [sent[0] for sent in reports.sent["batch"]] == [3_000, ROWS - 3_000]
