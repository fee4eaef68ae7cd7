"""A committed Iceberg run is read (by the sensor, its trigger, ``read_valid_manifest``) only while the
claim the provider keeps for the run names the attempt its snapshot records, and only below the
connection's roots.

A newer try of the run claims its claim directory before it commits; until it does, the table still
holds the older snapshot, and a zombie's snapshot that landed as the claim moved is current until it
is rolled back. Neither is the run's commit, and a run whose claim is gone is not either.

Anyone who can commit to the catalog writes snapshot summaries: a forged summary naming a manifest
outside the roots, or a ``gs://`` URI whose query sends the read to another endpoint, and a manifest
naming claim or run directories outside them, are refused before anything there is opened (the
tests record every storage handle built, and every request the listener gets).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_batchinfer.contract import ManifestError
from airflow_provider_batchinfer.runtime.output.table_commit import commit_table
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.commit.rundir import clear_run_directory
from airflow_provider_batchinfer.store.commit.verdicts import Verdicts
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.iceberg.catalog import embedded_catalog
from airflow_provider_batchinfer.store.iceberg.read import CATALOG_OPTION, ROOTS_OPTION, WAREHOUSE_ROOT, read_roots
from airflow_provider_batchinfer.store.roots import Refused
from airflow_provider_batchinfer.store.stage import Stage
from tests.forged_tables import (
    Listener,
    ambient_google_credentials,
    forge_snapshot,
    forged_run,
    gs_location,
    listening,
)
from tests.unit.test_iceberg_commit import TABLE, written_attempt

SECRET = "SECRET-row-outside-the-roots"


@pytest.fixture
def committed(tmp_path):
    """A run committed into the table by attempt t01first; its claim directory; how to read it."""
    props = embedded_catalog(str(tmp_path / "stage"), str(tmp_path))
    job, data_dir, manifest = written_attempt(tmp_path, props, "day1", "t01first", range(20))
    commit_table(job, data_dir, manifest)
    location = f"iceberg://{TABLE}/day1"
    # the connection's roots: its stage root holds the claims (tmp_path/claims) and the warehouse
    options = {CATALOG_OPTION: props, ROOTS_OPTION: read_roots(str(tmp_path), str(tmp_path / "registry"), props)}

    def read():
        return read_valid_manifest(location, options, verify_checksums=True)

    return job, Stage.open(job.table_output.claim_dir), read


def test_a_committed_run_passes_while_its_claim_names_its_attempt(committed):
    _, _, read = committed
    manifest = read()
    assert manifest.job.attempt == "t01first" and manifest.table.snapshot_id is not None


def test_a_snapshot_whose_attempt_the_claim_does_not_name_does_not_pass(committed):
    job, claim_dir, read = committed
    rundir.claim(claim_dir, dataclasses.replace(job, attempt="t02newer"))  # a newer try took the run over
    with pytest.raises(
        ManifestError,
        match=r"iceberg://ml.commits/day1 \(snapshot \d+\) was committed by attempt t01first, but the run directory "
        r"is claimed by attempt t02newer: a newer try owns it and has not committed",
    ):
        read()


def test_a_snapshot_whose_claim_is_gone_does_not_pass(committed):
    _, claim_dir, read = committed
    clear_run_directory(claim_dir)  # what a newer try's clean-up does before it claims
    with pytest.raises(
        ManifestError, match=r"committed by attempt t01first under the claim .*_job.json, which is gone"
    ):
        read()


# --- forged summaries and manifests: nothing outside the connection's roots is opened -------------------
@pytest.fixture
def forger(committed, tmp_path, tmp_path_factory, monkeypatch):
    """What a forger of day2 needs: the catalog, a place outside the roots, the sensor's read of day2,
    and every storage handle built while it reads."""
    read_day1 = committed[2]
    props = embedded_catalog(str(tmp_path / "stage"), str(tmp_path))
    options = {CATALOG_OPTION: props, ROOTS_OPTION: read_roots(str(tmp_path), str(tmp_path / "registry"), props)}
    built: list[str] = []
    original = Stage.__init__

    def spy(self: Stage, location: str, fs: Any, path: str) -> None:
        built.append(location)
        original(self, location, fs, path)

    monkeypatch.setattr(Stage, "__init__", spy)

    def read_day2():
        built.clear()
        return read_valid_manifest(f"iceberg://{TABLE}/day2", options, verify_checksums=True, verdicts=Verdicts())

    outside = tmp_path_factory.mktemp("outside")
    return {"props": props, "outside": outside, "read": read_day2, "built": built, "read_day1": read_day1}


def _outside_the_roots(built: list[str], root: Path) -> list[str]:
    return [loc for loc in built if not loc.replace("file://", "").startswith(str(root))]


def test_a_forged_summary_naming_a_manifest_outside_the_roots_is_refused_unread(forger, tmp_path):
    manifest_location, _ = forged_run(forger["outside"], TABLE, "day2", SECRET)
    forge_snapshot(forger["props"], TABLE, "day2", manifest_location)
    with pytest.raises(Refused) as info:
        forger["read"]()
    message = str(info.value)
    assert message.startswith(f"iceberg://{TABLE}/day2 (snapshot "), message
    assert (
        f"the manifest its summary names is refused, and nothing of it is read: {manifest_location} is outside "
        f"the connection's roots (stage_root {tmp_path}, registry_root {tmp_path}/registry)"
    ) in message
    assert _outside_the_roots(forger["built"], tmp_path) == []
    assert forger["read_day1"]().job.attempt == "t01first"  # the run the forger did not touch still reads


def test_a_forged_summary_naming_a_gs_endpoint_override_sends_no_request(forger, tmp_path, monkeypatch):
    Listener.requests.clear()
    with listening() as port:
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(ambient_google_credentials(tmp_path, port)))
        location = gs_location(port, "lake/_manifest.json")
        forge_snapshot(forger["props"], TABLE, "day2", location)
        with pytest.raises(Refused) as info:
            forger["read"]()
    assert Listener.requests == [], "the reader sent a request to the summary's endpoint"
    message = str(info.value)
    assert f"the manifest its summary names is refused, and nothing of it is read: {location!r} holds a query" in (
        message
    )
    assert f"runs are read only below the connection's roots (stage_root {tmp_path}, registry_root" in message
    assert _outside_the_roots(forger["built"], tmp_path) == []


@pytest.mark.parametrize("named", ["claim", "run"])
def test_a_manifest_in_the_roots_naming_a_directory_outside_them_is_refused(forger, tmp_path, named):
    """The forged manifest lies in the stage; its claim (or run) directory is a complete, consistent
    run outside the roots."""
    _, manifest = forged_run(forger["outside"], TABLE, "day2", SECRET)
    inside = tmp_path / "stage" / "forged"
    shutil.copytree(forger["outside"], inside)
    data = manifest.to_dict()
    if named == "run":  # the claim in the stage, the files outside
        data["table"]["claim_dir"] = str(inside / "claim")
    else:  # the files in the stage, the claim outside
        data["run_dir"] = str(inside / "run")
    (inside / "run" / "_manifest.json").write_text(json.dumps(data))
    forge_snapshot(forger["props"], TABLE, "day2", str(inside / "run" / "_manifest.json"))
    outside = forger["outside"] / named
    with pytest.raises(Refused, match=f"the {named} directory its manifest names is refused") as info:
        forger["read"]()
    assert f"{outside} is outside the connection's roots (stage_root {tmp_path}," in str(info.value)
    assert _outside_the_roots(forger["built"], tmp_path) == []


def test_a_run_directory_linked_out_of_the_roots_is_refused(forger, tmp_path):
    """A run directory in the stage that is a symlink to a complete run outside it."""
    _, manifest = forged_run(forger["outside"], TABLE, "day2", SECRET)
    inside = tmp_path / "stage" / "linked"
    (inside / "claim").mkdir(parents=True)
    shutil.copy(forger["outside"] / "claim" / "_job.json", inside / "claim" / "_job.json")
    (inside / "run").symlink_to(forger["outside"] / "run")
    data = {**manifest.to_dict(), "run_dir": str(inside / "run")}
    data["table"]["claim_dir"] = str(inside / "claim")
    (tmp_path / "stage" / "linked.json").write_text(json.dumps(data))
    forge_snapshot(forger["props"], TABLE, "day2", str(tmp_path / "stage" / "linked.json"))
    with pytest.raises(Refused) as info:
        forger["read"]()
    assert "the run directory its manifest names is refused" in str(info.value)
    assert f"{inside}/run resolves to {forger['outside']}/run, outside the connection's root {tmp_path}" in str(
        info.value
    )


def test_a_reader_given_no_roots_reads_nothing(committed, tmp_path):
    props = embedded_catalog(str(tmp_path / "stage"), str(tmp_path))
    for options in ({CATALOG_OPTION: props}, {CATALOG_OPTION: props, ROOTS_OPTION: {"stage_root": ""}}):
        with pytest.raises(Refused, match="reading an iceberg:// run needs the connection's roots under "):
            read_valid_manifest(f"iceberg://{TABLE}/day1", options, verify_checksums=True)


def test_the_roots_of_a_table_read_add_a_warehouse_the_connection_names_outside_the_stage():
    roots = {"stage_root": "/srv/stage", "registry_root": "s3://lake/registry"}
    assert read_roots(*roots.values(), {"warehouse": "file:///srv/stage/_iceberg/warehouse"}) == roots
    assert read_roots(*roots.values(), {"warehouse": "s3://lake/wh/"}) == {**roots, WAREHOUSE_ROOT: "s3://lake/wh"}
    assert read_roots(*roots.values(), {"warehouse": "file:///data/wh"})[WAREHOUSE_ROOT] == "file:///data/wh"
    for warehouse in ("lake", "", "s3://key:secret@lake/wh", "s3://lake/wh?endpoint_override=x", "wh/rel"):
        assert read_roots(*roots.values(), {"warehouse": warehouse}) == roots, warehouse
