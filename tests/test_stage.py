from __future__ import annotations

import pytest

from airflow_provider_batchinfer.stage import (
    SUCCESS_MARKER,
    ManifestError,
    Stage,
    StageError,
    read_valid_manifest,
    resolve_location,
    sanitize_run_key,
)


def test_run_keys_are_safe_stable_and_distinct():
    run_id = "manual__2026-11-23T01:18:23.440778+00:00"
    key = sanitize_run_key(run_id)
    assert key == sanitize_run_key(run_id)
    assert all(c.isalnum() or c in "._-" for c in key)
    assert key.startswith("manual__2026-11-23T01_18_23.440778_00_00-")
    # ids that differ only in replaced characters still get distinct directories
    assert sanitize_run_key("a:b") != sanitize_run_key("a+b")
    assert sanitize_run_key("scheduled__2026-11-01") == "scheduled__2026-11-01"
    for hostile in ("../../etc", "/abs/path", ".."):
        assert "/" not in sanitize_run_key(hostile) and not sanitize_run_key(hostile).startswith(".")


def test_locations_never_climb_out_of_their_root(tmp_path):
    assert resolve_location("embeddings/t", str(tmp_path)) == f"{tmp_path}/embeddings/t"
    assert resolve_location("/data/x/", None) == "/data/x"
    with pytest.raises(StageError, match="contains '..'"):
        resolve_location("../outside", str(tmp_path))
    with pytest.raises(StageError, match="contains '..'"):
        resolve_location("s3://bucket/a/../../b", None)
    with pytest.raises(StageError, match="no stage root is configured"):
        resolve_location("relative", None)


def test_clear_run_directory_removes_marker_and_everything_else(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    run.child("part-00000-a.parquet").write_bytes(b"x")
    run.child("_input", "part-00000.parquet").write_bytes(b"y")
    run.child(SUCCESS_MARKER).write_json({"format": "x"})
    assert run.clear_run_directory() == 3
    assert run.is_empty()


def _manifest(run: Stage, rows: int = 3) -> dict:
    run.child("part-0.parquet").write_bytes(b"abc")
    return {
        "format": "batchinfer.manifest/1",
        "run_dir": run.location,
        "files": [{"name": "part-0.parquet", "size": 3, "rows": rows}],
        "counts": {"input_rows": rows, "output_rows": rows, "error_rows": 0},
    }


def test_manifest_validation(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    assert read_valid_manifest(run.location) is None
    manifest = _manifest(run)
    run.child(SUCCESS_MARKER).write_json(manifest)
    assert read_valid_manifest(run.location)["counts"]["output_rows"] == 3

    run.child("part-0.parquet").write_bytes(b"abcd")
    with pytest.raises(ManifestError, match="part-0.parquet is 4 bytes but _SUCCESS says 3"):
        read_valid_manifest(run.location)
    run.child("part-0.parquet").delete()
    with pytest.raises(ManifestError, match="part-0.parquet is listed in _SUCCESS but missing"):
        read_valid_manifest(run.location)
    manifest = _manifest(run)
    manifest["counts"]["input_rows"] = 5
    run.child(SUCCESS_MARKER).write_json(manifest)
    with pytest.raises(ManifestError, match="input_rows 5 != output_rows 3"):
        read_valid_manifest(run.location)
    run.child(SUCCESS_MARKER).write_bytes(b"{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_valid_manifest(run.location)
