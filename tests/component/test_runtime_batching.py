"""How the runtime batches and where it finds Ray: pure functions and one real TorchScript model."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_batchinfer.runtime.attach import ray_init_kwargs
from airflow_provider_batchinfer.runtime.model.flavors import torchscript, transfer_rows
from airflow_provider_batchinfer.runtime.output.parts import row_bytes


def test_no_configured_address_means_a_fresh_local_ray_never_a_stray_cluster():
    # ray.init(address=None) would attach to whatever /tmp/ray/ray_current_cluster names
    assert ray_init_kwargs(None, {})["address"] == "local"  # JobFile.ray_address
    assert ray_init_kwargs(None, {})["include_dashboard"] is False
    # a Ray the job starts keeps its idle read and write workers; a named cluster keeps its own setting
    assert ray_init_kwargs(None, {})["_system_config"] == {"num_workers_soft_limit": 64}
    assert "_system_config" not in ray_init_kwargs("127.0.0.1:6379", {})
    assert ray_init_kwargs("127.0.0.1:6379", {})["address"] == "127.0.0.1:6379"
    assert ray_init_kwargs(None, {"RAY_ADDRESS": "auto"})["address"] == "auto"


def test_transfer_batches_are_larger_than_model_calls_only_where_the_flavor_says_so():
    assert transfer_rows("torchscript", 256, row_bytes=264.0) == 65536
    assert transfer_rows("torchscript", 256, row_bytes=4 << 20) == 256  # bounded by bytes, never below max_rows
    assert transfer_rows("torchscript", 100_000, row_bytes=8.0) == 100_000
    assert transfer_rows("sentence_transformers", 256, row_bytes=500.0) == 4096
    assert transfer_rows("python", 256, row_bytes=8.0) == 256  # a user's predict() sees what they asked for


def test_row_bytes_reads_only_the_footer_of_the_columns_asked_for(tmp_path):
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": rng.integers(0, 2**62, 1000),
            "x": rng.standard_normal(1000).astype(np.float32),
            "text": [f"{i:03d}" + "a" * 97 for i in range(1000)],
        }
    )
    pq.write_table(table, tmp_path / "in.parquet", compression="none", use_dictionary=False)
    narrow = row_bytes(str(tmp_path / "in.parquet"), ["id", "x"], None)
    wide = row_bytes(str(tmp_path / "in.parquet"), ["id", "x", "text"], None)
    assert 12 <= narrow < 20 and wide > narrow + 50


def test_torchscript_calls_the_model_with_at_most_max_batch_rows(tmp_path):
    import torch

    class RowsInCall(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.full((x.shape[0], 1), float(x.shape[0])) + 0 * x[:, :1]

    torch.jit.script(RowsInCall()).save(str(tmp_path / "model.pt"))
    manifest = {
        "options": {"file": "model.pt"},
        "signature": {"inputs": {"a": "float32", "b": "float32"}, "outputs": {"rows_in_call": "float32"}},
    }
    predict = torchscript.load(tmp_path, manifest, device="cpu", threads=1, max_rows=256)
    inputs = pa.table({"a": np.arange(1000, dtype=np.float32), "b": np.ones(1000, np.float32)})
    out = predict(inputs, {})["rows_in_call"]
    assert len(out) == 1000
    assert out.max() == 256 and sorted(set(out.tolist())) == [232.0, 256.0]  # 3 x 256 + 232
    whole = torchscript.load(tmp_path, manifest, device="cpu", threads=1, max_rows=None)(inputs, {})["rows_in_call"]
    assert set(whole.tolist()) == {1000.0}


def test_small_tabular_models_are_called_in_cache_sized_calls_on_cpu_when_the_job_leaves_it_unset():
    from airflow_provider_batchinfer.runtime.model.flavors import call_rows, torchscript

    # 256-row TorchScript calls paid a fixed cost 16 times as often (8x slower per row when Ray's
    # read and write tasks shared the two cores); whole 65,536-row batches left the CPU caches
    assert call_rows("torchscript", "cpu", None) == torchscript.CPU_CALL_ROWS == 4096
    assert call_rows("torchscript", "cuda", None) == 256  # GPU memory: Tuning.call_rows
    # a job's own value is the most rows of a call, exactly: never raised, never replaced
    assert call_rows("torchscript", "cpu", 256) == 256
    assert call_rows("torchscript", "cpu", 65536) == 65536
    assert call_rows("torchscript", "cuda", 100) == 100
    assert call_rows("python", "cpu", None) == 256 and call_rows("python", "cpu", 100) == 100


def test_tree_and_scikit_learn_models_are_called_with_16384_rows_on_cpu_by_default():
    from airflow_provider_batchinfer.runtime.model.flavors import call_rows
    from airflow_provider_batchinfer.runtime.model.flavors.tabular.tabular_inputs import CPU_CALL_ROWS

    # XGBoost over 1M rows: 2.63 s in 256-row calls, 1.42 s in 16,384-row ones
    assert CPU_CALL_ROWS == 16384
    for flavor in ("xgboost", "lightgbm", "sklearn"):
        assert call_rows(flavor, "cpu", None) == 16384, flavor
        assert call_rows(flavor, "cpu", 256) == 256, flavor  # the job's own, exactly
        assert call_rows(flavor, "cpu", 100_000) == 100_000, flavor
        assert call_rows(flavor, "cuda", None) == 256, flavor


def test_the_nan_check_finds_nan_but_not_infinities_that_cancel():
    import pytest

    from airflow_provider_batchinfer.runtime.errors import BadRowError, check_batch

    ids = ("id", pa.array([10, 11, 12, 13]))
    fine = pa.table({"x": pa.array([np.inf, -np.inf, 1.0, 2.0], pa.float32())})  # sums to NaN, holds none
    check_batch(fine, ["x"], ids, None)
    bad = pa.table({"x": pa.array([1.0, 2.0, np.nan, 3.0])})
    with pytest.raises(BadRowError, match=r"column 'x' has 1 NaN value\(s\) in a batch of 4 rows \(first at id=12\)"):
        check_batch(bad, ["x"], ids, None)


def test_a_batch_is_never_larger_than_what_one_input_file_holds():
    from airflow_provider_batchinfer.runtime.planning.pipeline import batch_rows_for_input

    # a block smaller than the batch waited ~20 s for Ray Data's end-of-input flush
    assert batch_rows_for_input(65536, 256, 100, 1) == 100
    assert batch_rows_for_input(65536, 256, 10_000, 1) == 10_000
    assert batch_rows_for_input(65536, 256, 10_000, 4) == 2_500
    assert batch_rows_for_input(65536, 256, 1_000_000, 4) == 65536
    assert batch_rows_for_input(1024, 256, 10_000, 4) == 1024
    assert batch_rows_for_input(256, 256, 50, 2) == 25 and batch_rows_for_input(256, 256, 0, 1) == 256


def test_sentence_transformers_calls_are_encodes_32_on_cpu_and_256_on_a_gpu_unless_the_job_says():
    from airflow_provider_batchinfer.runtime.model.flavors import call_rows
    from airflow_provider_batchinfer.runtime.model.flavors.sentence_transformers import encode_batch_size

    assert call_rows("sentence_transformers", "cpu", None) == 32  # encode's own default
    assert call_rows("sentence_transformers", "cuda", None) == 256
    assert call_rows("sentence_transformers", "cpu", 512) == 512  # JobSpec.max_batch_rows, exactly
    assert encode_batch_size({}, 32) == 32
    assert encode_batch_size({}, 256) == 256
    assert encode_batch_size({}, 512) == 512
    # the job's own batch_size wins, never above the rows per call
    assert encode_batch_size({"batch_size": 64}, 256) == 64
    assert encode_batch_size({"batch_size": 64}, 32) == 32
    assert encode_batch_size({"batch_size": 1024}, 256) == 256


def test_features_transposed_on_the_device_are_the_same_matrix_and_contiguous():
    rng = np.random.default_rng(3)
    inputs = pa.table(
        {
            "a": rng.standard_normal(1000).astype(np.float32),
            "b": np.arange(1000, dtype=np.int64),
            "c": rng.standard_normal(1000),  # float64
        }
    )
    expected = torchscript.features(inputs)
    there = torchscript.feature_tensor(inputs, "cpu", transpose_there=True)
    here = torchscript.feature_tensor(inputs, "cpu")
    assert there.shape == (1000, 3) and there.is_contiguous() and str(there.dtype) == "torch.float32"
    np.testing.assert_array_equal(there.numpy(), expected)
    np.testing.assert_array_equal(here.numpy(), expected)
    single = pa.table({"v": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32(), 2))})
    np.testing.assert_array_equal(
        torchscript.feature_tensor(single, "cpu", transpose_there=True).numpy(), [[1, 2], [3, 4]]
    )
