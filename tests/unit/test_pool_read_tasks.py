"""The actor pool's read tasks take a fixed share of the input, whatever its files' sizes.

Ray Data packs Parquet row groups into read tasks of up to 128 MiB by default; each read task's
rows go through one replica call stream and one write task as blocks of about that size, and the
workers keep the memory they touched, so a job's peak memory grew with its files. ``read_input``
plans the read with ``Tuning.read_task_bytes`` instead (``runtime/output/parts.py``)."""

from __future__ import annotations

import inspect

from airflow_provider_batchinfer.runtime.output.parts import FOOTER_ACTORS_ENV, READ_TASK_BYTES_ENV, read_env
from airflow_provider_batchinfer.runtime.tuning import TUNING


def test_read_tasks_are_planned_at_the_tuned_size_and_footer_readers_by_the_files():
    assert TUNING.read_task_bytes == 16 << 20
    assert read_env(40) == {FOOTER_ACTORS_ENV: "1", READ_TASK_BYTES_ENV: str(16 << 20)}
    assert read_env(401)[FOOTER_ACTORS_ENV] == "3"


def test_ray_data_still_reads_the_read_task_size_from_that_variable():
    # a Ray upgrade that renames it would silently bring back 128 MiB read tasks
    from ray.data._internal.datasource_v2.formats.parquet.parquet_datasource_v2 import ParquetDatasourceV2

    assert READ_TASK_BYTES_ENV in inspect.getsource(ParquetDatasourceV2.get_file_partitioner)


def test_replicas_that_read_their_own_input_take_larger_blocks_but_never_fewer_than_two_each():
    from airflow_provider_batchinfer.runtime.engine.pool_dataset import replica_read_bytes

    mib = 1 << 20
    assert TUNING.replica_read_task_bytes == 64 * mib
    assert replica_read_bytes(2_560 * mib, replicas=1) == 64 * mib  # 10M rows of 64 float32 features
    assert replica_read_bytes(200 * mib, replicas=2) == 50 * mib  # two read tasks per replica
    assert replica_read_bytes(100 * mib, replicas=4) == 16 * mib  # never below the pool's own size
    assert replica_read_bytes(0, replicas=1) == 16 * mib
    assert read_env(40, 64 * mib)[READ_TASK_BYTES_ENV] == str(64 * mib)


def test_a_write_task_gathers_a_fixed_share_of_input_bytes_unless_the_parts_rows_are_set_upstream():
    from types import SimpleNamespace

    from airflow_provider_batchinfer.runtime.engine.pool_dataset import rows_per_write

    def checked(row_bytes: float, rows_per_part: int | None = None, reuse: object = None) -> SimpleNamespace:
        spec = SimpleNamespace(rows_per_part=rows_per_part)
        return SimpleNamespace(row_bytes=row_bytes, reuse=reuse, job=SimpleNamespace(job_spec=spec))

    assert TUNING.write_task_bytes == 128 << 20
    assert rows_per_write(checked(256.0)) == 524_288  # 64 float32 features a row
    assert rows_per_write(checked(0.0)) is None  # no row size from the footers: a part per block
    assert rows_per_write(checked(256.0, rows_per_part=1_000)) is None  # RESUME's unit: a part per cut
    assert rows_per_write(checked(256.0, reuse=object())) is None  # incremental keyed parts: one per block
