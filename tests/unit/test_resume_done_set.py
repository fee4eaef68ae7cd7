"""SaveMode.RESUME's done set (runtime/rows/done_set.py, runtime/rows/resume.py): the rows left to score are
found under a fixed memory budget, exactly, whatever the order the kept parts hold the ids in."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_batchinfer.runtime import tuning
from airflow_provider_batchinfer.runtime.rows.resume import REMAINING_DIR, discard_remaining, resume_state
from airflow_provider_batchinfer.store.commit.rundir import claim
from airflow_provider_batchinfer.store.stage import Stage
from tests.runs import job_file


def _input(tmp_path, ids: np.ndarray, files: int) -> tuple[list[str], list[list[int]]]:
    """``files`` Parquet files of the ``ids`` (in order) with one float32 feature, two row groups each."""
    (tmp_path / "in").mkdir()
    locations, groups = [], []
    for i, chunk in enumerate(np.array_split(ids, files)):
        path = tmp_path / "in" / f"{i}.parquet"
        table = pa.table({"id": pa.array(chunk, pa.int64()), "x": pa.array(chunk.astype(np.float32) / 7)})
        pq.write_table(table, path, row_group_size=(len(chunk) + 1) // 2)
        locations.append(str(path))
        groups.append([g.num_rows for g in (pq.ParquetFile(path).metadata.row_group(k) for k in range(2))])
    return locations, groups


def _resumed(tmp_path, locations: list[str], earlier: tuple[str, ...] = ("t01aaaa",)):
    """A resumed attempt whose claim lists the ``earlier`` attempts' parts as resumable."""
    run_dir = Stage.open(str(tmp_path / "run"))
    job = dataclasses.replace(
        job_file(tmp_path / "run", attempt="t02bbbb", inputs=tuple(locations)),
        resume=True,
        resumable=(*earlier, "t02bbbb"),
    )
    claim(run_dir, job)
    return job, run_dir


def _ids_read(kept) -> np.ndarray:
    return pq.read_table(kept["read"].files, columns=["id"])["id"].to_numpy()


def test_the_rows_left_are_exact_with_a_done_set_larger_than_the_memory_budget(tmp_path, monkeypatch):
    """220k kept ids in partitions of 10k (the budget: ``Tuning.resume_rows_per_partition``): the
    rows read are exactly the input's minus the kept ones. An input file without done rows is read
    as it is, one with only done rows is skipped, and the rest of a partly done one is copied under
    ``_resume/<attempt>/`` with its other columns (about 1 s)."""
    monkeypatch.setattr(tuning, "TUNING", dataclasses.replace(tuning.TUNING, resume_rows_per_partition=10_000))
    rng = np.random.default_rng(7)
    ids = rng.permutation(320_000).astype(np.int64) * 3  # not the row numbers
    locations, groups = _input(tmp_path, ids, files=4)
    quarter = len(ids) // 4
    left = np.concatenate([rng.choice(ids[2 * quarter : 3 * quarter], 10_000, replace=False),
                           rng.choice(ids[3 * quarter :], 10_000, replace=False)])  # fmt: skip
    done = rng.permutation(np.setdiff1d(ids[quarter:], left))  # file 1 whole, files 2 and 3 but for 10k rows
    job, run_dir = _resumed(tmp_path, locations)
    for n, chunk in enumerate(np.array_split(done, 5)):  # parts mix rows of every file, as the pool's do
        pq.write_table(pa.table({"id": chunk, "y": chunk * 2.0}), tmp_path / "run" / f"part-{n:05d}-t01aaaa.parquet")

    kept = resume_state(job, run_dir, locations, groups, ["id", "x"])

    assert kept["rows"] == len(done) == 220_000 and kept["removed"] == [] and kept["resume_s"] > 0
    read = kept["read"]
    assert read.files[0] == locations[0] and len(read.files) == 3  # untouched as is; file 1 skipped
    copies = sorted(p.name for p in (tmp_path / "run" / REMAINING_DIR / "t02bbbb").iterdir())
    assert copies == ["rest-00002.parquet", "rest-00003.parquet"] and read.groups[0] == groups[0]
    assert [sum(g) for g in read.groups] == [quarter, 10_000, 10_000]
    got = _ids_read(kept)
    assert len(got) == quarter + len(left)
    assert np.array_equal(np.sort(got), np.sort(np.concatenate([ids[:quarter], left])))
    rest = pq.read_table(read.files[1])
    assert rest.column_names == ["id", "x"]
    assert np.allclose(rest["x"].to_numpy(), rest["id"].to_numpy().astype(np.float32) / 7)  # rows kept whole
    discard_remaining(run_dir, job.attempt)
    assert not (tmp_path / "run" / REMAINING_DIR / "t02bbbb").exists()


def test_a_part_repeating_rows_of_a_newer_one_is_removed_and_its_rows_are_read_again(tmp_path):
    """The kept ids outnumber the input rows they match: of two parts sharing ids, the one of the
    older attempt (in the claim's order) is deleted, and only the newer part's rows count as done.
    Every row done: one empty file is read."""
    locations, groups = _input(tmp_path, np.arange(10, dtype=np.int64), files=2)
    job, run_dir = _resumed(tmp_path, locations, earlier=("t01a", "t01b", "t02c"))
    pq.write_table(pa.table({"id": pa.array([0, 1, 2, 7], pa.int64())}), tmp_path / "run" / "part-00000-t01a.parquet")
    pq.write_table(pa.table({"id": pa.array([2, 3], pa.int64())}), tmp_path / "run" / "part-00001-t01b.parquet")

    kept = resume_state(job, run_dir, locations, groups, ["id", "x"])

    assert kept["removed"] == ["part-00000-t01a.parquet"] and kept["rows"] == 2
    assert not (tmp_path / "run" / "part-00000-t01a.parquet").exists()
    assert sorted(_ids_read(kept).tolist()) == [0, 1, 4, 5, 6, 7, 8, 9]

    pq.write_table(
        pa.table({"id": pa.array([0, 1, 4, 5, 6, 7, 8, 9], pa.int64())}), tmp_path / "run" / "part-00002-t02c.parquet"
    )
    kept = resume_state(job, run_dir, locations, groups, ["id", "x"])
    assert kept["rows"] == 10 and len(kept["read"].files) == 1 and len(_ids_read(kept)) == 0
