from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, Manifest, ManifestError
from airflow_provider_batchinfer.store.commit.markers import committed_files, dead_letter_files, validate_manifest
from airflow_provider_batchinfer.store.commit.rundir import clear_run_directory
from airflow_provider_batchinfer.store.committed import read_committed, read_valid_manifest
from airflow_provider_batchinfer.store.locations import StageError, resolve_location, sanitize_run_key
from airflow_provider_batchinfer.store.stage import Stage
from tests.runs import manifest_for, parquet_bytes, write_part


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
    run.child(SUCCESS_MARKER).write_bytes(b"{}")
    assert clear_run_directory(run) == 3
    assert run.is_empty()


def _manifest(run: Stage, rows: int = 3) -> Manifest:
    entry = write_part(Path(run.path), "part-0.parquet", list(range(rows)))
    return manifest_for(run.location, (entry,))


def _write(run: Stage, manifest: Manifest) -> None:
    run.child(SUCCESS_MARKER).write_bytes(manifest.to_json().encode())


def test_manifest_validation(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    assert read_valid_manifest(run.location) is None
    manifest = _manifest(run)
    _write(run, manifest)
    assert read_valid_manifest(run.location).counts.output_rows == 3

    size = manifest.files[0].size
    run.child("part-0.parquet").write_bytes(b"a" * (size + 1))
    with pytest.raises(ManifestError, match=f"part-0.parquet is {size + 1} bytes but _SUCCESS says {size}"):
        read_valid_manifest(run.location)
    run.child("part-0.parquet").delete()
    with pytest.raises(ManifestError, match="part-0.parquet is listed in _SUCCESS but missing"):
        read_valid_manifest(run.location)
    manifest = _manifest(run)
    _write(run, dataclasses.replace(manifest, counts=dataclasses.replace(manifest.counts, input_rows=5)))
    with pytest.raises(ManifestError, match="input_rows 5 != output_rows 3"):
        read_valid_manifest(run.location)
    run.child(SUCCESS_MARKER).write_bytes(b"{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_valid_manifest(run.location)


def test_every_listed_part_must_have_a_parquet_footer_with_its_rows(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    manifest = _manifest(run)
    _write(run, manifest)
    size = manifest.files[0].size
    for garbage in (
        b"x" * size,
        b"PAR1" + b"x" * (size - 8) + b"PAR1",
        b"x" * (size - 8) + (10**6).to_bytes(4, "little") + b"PAR1",
    ):
        run.child("part-0.parquet").write_bytes(garbage)
        with pytest.raises(
            ManifestError,
            match="part-0.parquet is not a readable Parquet file .* overwritten or truncated after the commit",
        ):
            read_valid_manifest(run.location)
    # a real Parquet file of the right size but other rows: the footer says how many it holds
    other = write_part(Path(run.path), "part-0.parquet", [7, 8])
    _write(run, dataclasses.replace(manifest, files=(dataclasses.replace(manifest.files[0], size=other.size),)))
    with pytest.raises(ManifestError, match="part-0.parquet holds 2 rows but _SUCCESS says 3"):
        read_valid_manifest(run.location)


def test_dead_letter_files_are_validated_too(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    part = write_part(Path(run.path), "part-00000-t01aaaa.parquet", [1, 2])
    errors = write_part(Path(run.path), "_errors/part-00000-t01aaaa.parquet", [3])
    manifest = manifest_for(run.location, (part,), (errors,))
    _write(run, manifest)
    assert read_valid_manifest(run.location, verify_checksums=True) == manifest
    assert dead_letter_files(manifest) == [f"{run.location}/_errors/part-00000-t01aaaa.parquet"]
    assert dead_letter_files(manifest.to_dict()) == dead_letter_files(manifest)
    assert committed_files(manifest.to_dict()) == [f"{run.location}/part-00000-t01aaaa.parquet"]
    Path(run.path, errors.name).write_bytes(b"\0" * errors.size)
    with pytest.raises(ManifestError, match="_errors/part-00000-t01aaaa.parquet is not a readable Parquet file"):
        read_valid_manifest(run.location)


def test_checksums_are_verified_when_asked(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    manifest = _manifest(run)
    _write(run, manifest)
    assert read_valid_manifest(run.location, verify_checksums=True) == manifest
    # same size, valid footer, same row count, different bytes: only the checksum can tell
    forged = parquet_bytes([0, 1, 2], scores=[0.0, 1.0, 1.5])
    assert len(forged) == manifest.files[0].size
    run.child("part-0.parquet").write_bytes(forged)
    assert read_valid_manifest(run.location) == manifest
    with pytest.raises(
        ManifestError, match="part-0.parquet does not match its sha256 in _SUCCESS .* changed after the commit"
    ):
        read_valid_manifest(run.location, verify_checksums=True)
    with pytest.raises(ManifestError, match="does not match its sha256"):
        read_committed(manifest)
    assert read_committed(manifest, verify_checksums=False).column("score").to_pylist() == [0.0, 1.0, 1.5]


def test_read_committed_reads_exactly_the_listed_files_once(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    parts = (
        write_part(Path(run.path), "part-00000-t01aaaa.parquet", [1, 2]),
        write_part(Path(run.path), "part-00001-t01aaaa.parquet", [3]),
    )
    write_part(Path(run.path), "part-00000-t00stale.parquet", [99])  # not listed: never read
    manifest = manifest_for(run.location, parts)
    assert read_committed(manifest).column("id").to_pylist() == [1, 2, 3]
    assert read_committed(manifest.to_dict(), columns=["score"]).column_names == ["score"]
    with pytest.raises(ManifestError, match="commits no files"):
        read_committed(manifest_for(run.location, ()))


def test_a_format_1_marker_reads_but_cannot_be_verified(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    entry = dataclasses.replace(write_part(Path(run.path), "part-0.parquet", [1, 2]), sha256=None)
    manifest = manifest_for(run.location, (entry,), fmt="batchinfer.manifest/1")
    _write(run, manifest)
    assert read_valid_manifest(run.location) == manifest
    for read in (lambda: read_valid_manifest(run.location, verify_checksums=True), lambda: read_committed(manifest)):
        with pytest.raises(
            ManifestError,
            match="is a batchinfer.manifest/1 marker and records no checksums, so its "
            "files cannot be verified; read it with verify_checksums=False",
        ):
            read()
    assert read_committed(manifest, verify_checksums=False).num_rows == 2


def test_a_minimal_manifest_is_refused_naming_the_missing_key(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    manifest = _manifest(run).to_dict()
    for key in ("model", "job", "input", "run_dir"):
        minimal = {k: v for k, v in manifest.items() if k != key}
        run.child(SUCCESS_MARKER).write_json(minimal)
        with pytest.raises(ManifestError, match=f"_SUCCESS has no {key!r}"):
            read_valid_manifest(run.location)


def test_a_listed_name_that_climbs_out_of_the_run_directory_is_refused(tmp_path):
    run = Stage.open(str(tmp_path / "run"))
    manifest = _manifest(run)
    escaping = dataclasses.replace(manifest, files=(dataclasses.replace(manifest.files[0], name="../x.parquet"),))
    with pytest.raises(StageError, match="contains '..'"):
        validate_manifest(run, escaping)
    with pytest.raises(StageError, match="contains '..'"):
        read_committed(escaping)
