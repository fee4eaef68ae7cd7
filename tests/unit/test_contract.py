"""The typed contract (contract.py) on its own: round trips, format 1, every malformed manifest
named by its key, the layout names and the runtime's last line. No files, no Ray, no Airflow."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any

import pytest

from airflow_provider_batchinfer.contract import (
    ERROR_PREFIX,
    JOB_FORMAT,
    MANIFEST_FORMAT,
    RESULT_PREFIX,
    ContractError,
    Counts,
    FileEntry,
    JobFailure,
    JobFile,
    JobResult,
    Manifest,
    ManifestError,
    ResumeInfo,
    attempt_of,
    is_part_name,
    last_failure,
    new_attempt_id,
    parse_runtime_line,
    part_name,
)
from tests.runs import OWNER, job_file, manifest_for

SHA = "ab" * 32


def _manifest() -> Manifest:
    files = (
        FileEntry(part_name(0, "t01aaaa"), size=100, rows=3, sha256=SHA),
        FileEntry(part_name(1, "t01aaaa"), size=90, rows=2, sha256=SHA),
    )
    errors = (FileEntry(part_name(0, "t01aaaa", dead_letter=True), size=50, rows=1, sha256=SHA),)
    base = manifest_for("/stage/run1", files, errors)
    return dataclasses.replace(
        base,
        passthrough_columns=("id",),
        output_columns=("score",),
        on_error="dead_letter",
        max_error_fraction=0.5,
        started_at="2026-11-23T01:00:00+00:00",
        finished_at="2026-11-23T01:01:00+00:00",
        timings={"total_s": 60.0, "rows_per_s": None},
        resume=ResumeInfo(
            resumed=True, kept_files=1, kept_rows=3, processed_rows=3, removed_files=("part-00009-t00old.parquet",)
        ),
    )


def _data() -> dict[str, Any]:
    return copy.deepcopy(_manifest().to_dict())


# --- round trips ---------------------------------------------------------------------------------------


def test_job_file_round_trips():
    job = job_file("/stage/run1")
    assert JobFile.from_dict(job.to_dict()) == job
    assert JobFile.from_json(job.to_json()) == job
    assert json.loads(job.to_json())["format"] == JOB_FORMAT


def test_job_file_errors_name_the_key():
    data = job_file("/stage/run1").to_dict()
    with pytest.raises(
        ContractError,
        match=r"_job.json is a 'batchinfer.job/9' job file; this version of the "
        r"provider reads 'batchinfer.job/1'",
    ):
        JobFile.from_dict({**data, "format": "batchinfer.job/9"})
    with pytest.raises(ContractError, match=r"_job.json.airflow has no 'run_id'"):
        JobFile.from_dict({**data, "airflow": {k: v for k, v in data["airflow"].items() if k != "run_id"}})
    with pytest.raises(ContractError, match=r"_job.json.input.locations must be a list of strings"):
        JobFile.from_dict({**data, "input": {"locations": [1]}})
    with pytest.raises(ContractError, match="not valid JSON"):
        JobFile.from_json("{")


def test_an_older_job_file_with_max_batch_rows_256_still_loads():
    # job files written before max_batch_rows became optional carry the old default, 256: read as a
    # job that set it (exactly 256 rows per call); a file without it reads as unset (the kind decides)
    data = job_file("/stage/run1").to_dict()
    old = JobFile.from_json(json.dumps({**data, "job_spec": {**data["job_spec"], "max_batch_rows": 256}}))
    assert old.job_spec.max_batch_rows == 256
    without = {k: v for k, v in data["job_spec"].items() if k != "max_batch_rows"}
    assert JobFile.from_dict({**data, "job_spec": without}).job_spec.max_batch_rows is None
    assert json.loads(job_file("/stage/run1").to_json())["job_spec"]["max_batch_rows"] is None


def test_manifest_round_trips_through_its_dict_and_json():
    manifest = _manifest()
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.to_dict()["format"] == MANIFEST_FORMAT
    assert manifest.file_names == [part_name(0, "t01aaaa"), part_name(1, "t01aaaa")]
    assert manifest.error_file_names == ["_errors/part-00000-t01aaaa.parquet"]
    assert manifest.airflow == OWNER and "signature" not in manifest.to_dict()["model"]


def test_a_format_1_marker_reads_without_checksums():
    data = _data()
    data["format"] = "batchinfer.manifest/1"
    for entry in data["files"] + data["error_files"]:
        del entry["sha256"]
    for key in ("error_policy", "resume", "columns", "airflow", "started_at", "finished_at", "timings"):
        del data[key]  # 0.1.0 wrote them, but none is needed to read a marker
    manifest = Manifest.from_dict(data)
    assert manifest.format == "batchinfer.manifest/1" and all(f.sha256 is None for f in manifest.files)
    assert manifest.airflow is None and manifest.on_error == "fail" and manifest.resume == ResumeInfo()
    assert Manifest.from_dict(manifest.to_dict()) == manifest


# --- malformed manifests -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["format", "run_dir", "files", "counts", "model", "job", "input"])
def test_a_missing_key_is_named(key):
    data = _data()
    del data[key]
    with pytest.raises(ManifestError, match=f"_SUCCESS has no {key!r}"):
        Manifest.from_dict(data)


@pytest.mark.parametrize(
    ("path", "key"),
    [
        (("counts",), "output_rows"),
        (("model",), "sha256"),
        (("job",), "attempt"),
        (("input",), "files"),
        (("files", 1), "size"),
        (("files", 0), "sha256"),
        (("error_files", 0), "rows"),
        (("airflow",), "dag_id"),
    ],
)
def test_a_missing_nested_key_is_named_with_its_path(path, key):
    data = _data()
    target = data
    for step in path:
        target = target[step]
    del target[key]
    where = "_SUCCESS" + "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path)
    with pytest.raises(ManifestError, match=re.escape(f"{where} has no {key!r}")):
        Manifest.from_dict(data)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(files="part-0.parquet"), r"_SUCCESS.files must be a list, got str"),
        (lambda d: d.update(run_dir=7), r"_SUCCESS.run_dir must be a string, got int"),
        (lambda d: d["counts"].update(input_rows="6"), r"_SUCCESS.counts.input_rows must be a whole number, got str"),
        (lambda d: d["files"][0].update(rows=True), r"_SUCCESS.files\[0\].rows must be a whole number, got True"),
        (lambda d: d["files"][0].update(size=-1), r"_SUCCESS.files\[0\]: size and rows must be >= 0"),
        (lambda d: d["input"].update(files=["a", 2]), r"_SUCCESS.input.files must be a list of strings"),
        (lambda d: d["job"].update(replicas="2"), r"_SUCCESS.job.replicas must be a whole number"),
        (lambda d: d.update(timings=[]), r"_SUCCESS.timings must be an object"),
    ],
)
def test_a_wrong_type_is_named(mutate, message):
    data = _data()
    mutate(data)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(data)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["counts"].update(input_rows=7), r"input_rows 7 != output_rows 5 \+ error_rows 1"),
        (lambda d: d["counts"].update(output_rows=4, input_rows=5), r"files hold 5 rows but output_rows is 4"),
        (lambda d: d["counts"].update(error_rows=0, input_rows=5), r"error_files hold 1 rows but error_rows is 0"),
    ],
)
def test_counts_that_do_not_reconcile_are_refused(mutate, message):
    data = _data()
    mutate(data)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(data)
    with pytest.raises(ManifestError, match=message):
        dataclasses.replace(_manifest(), counts=Counts(**data["counts"])).check_counts()


@pytest.mark.parametrize("name", ["../other/part.parquet", "a/../../b.parquet", "/etc/passwd", "..\\x.parquet", ""])
def test_a_file_name_outside_the_run_directory_is_refused(name):
    data = _data()
    data["files"][1]["name"] = name
    with pytest.raises(ManifestError, match=r"_SUCCESS.files\[1\].name=.* must be a path inside the run directory"):
        Manifest.from_dict(data)


@pytest.mark.parametrize("sha", ["AB" * 32, "ab" * 31, "zz" * 32, ""])
def test_a_malformed_sha256_is_refused(sha):
    data = _data()
    data["error_files"][0]["sha256"] = sha
    with pytest.raises(ManifestError, match=r"_SUCCESS.error_files\[0\].sha256 must be 64 lowercase hex digits"):
        Manifest.from_dict(data)


def test_what_is_not_a_manifest_says_so():
    with pytest.raises(ManifestError, match="_SUCCESS must be a JSON object, got list"):
        Manifest.from_dict([])
    with pytest.raises(ManifestError, match=r"_SUCCESS is not a batchinfer manifest \(format 'x'"):
        Manifest.from_dict({**_data(), "format": "x"})
    with pytest.raises(ManifestError, match="/run/_SUCCESS is not valid JSON"):
        Manifest.from_json(b"\xff", "/run/_SUCCESS")
    assert issubclass(ManifestError, ContractError)


# --- layout names ----------------------------------------------------------------------------------------


def test_part_names_carry_their_attempt():
    assert part_name(3, "t02abcd") == "part-00003-t02abcd.parquet"
    assert part_name(3, "t02abcd", dead_letter=True) == "_errors/part-00003-t02abcd.parquet"
    assert is_part_name("_errors/part-00003-t02abcd.parquet") and not is_part_name("_input/part-00000.parquet")
    assert attempt_of("part-00003-t02abcd.parquet") == "t02abcd" and attempt_of("_job.json") is None
    first, second = new_attempt_id(2), new_attempt_id(2)
    assert first.startswith("t02") and first != second and new_attempt_id(None).startswith("t00")
    assert is_part_name(part_name(0, first))


# --- the runtime's last line -------------------------------------------------------------------------------


def test_result_and_error_lines_round_trip():
    assert parse_runtime_line(JobResult(rows=5, files=2).to_line() + "\n") == JobResult(rows=5, files=2)
    failure = JobFailure(error="AccessDenied on s3://b/k", type="S3StageError", permanent=True)
    assert parse_runtime_line(failure.to_line()) == failure
    assert parse_runtime_line(ERROR_PREFIX + '{"error": "boom"}') == JobFailure(error="boom")
    assert parse_runtime_line("[batchinfer] 10 rows/s") is None


def test_an_unreadable_runtime_line_is_a_failure_not_a_crash():
    for line in (RESULT_PREFIX + "{not json", RESULT_PREFIX + '{"rows": 1}', ERROR_PREFIX + "[]"):
        parsed = parse_runtime_line(line)
        assert isinstance(parsed, JobFailure) and parsed.error.startswith("unreadable runtime line: ")
        assert parsed.permanent is False


def test_last_failure_is_the_last_error_line_of_a_log():
    log = [
        "start",
        JobFailure(error="first").to_line(),
        "more",
        JobFailure(error="second", permanent=True).to_line(),
        JobResult(rows=1, files=1).to_line(),
    ]
    assert last_failure(log) == JobFailure(error="second", permanent=True)
    assert last_failure("\n".join(log)) == JobFailure(error="second", permanent=True)
    assert last_failure(["start", JobResult(rows=1, files=1).to_line()]) is None
    assert last_failure("") is None
