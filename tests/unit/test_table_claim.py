"""A committed Iceberg run is read (by the sensor, its trigger, ``read_valid_manifest``) only while the
claim the provider keeps for the run names the attempt its snapshot records.

A newer try of the run claims its claim directory before it commits; until it does, the table still
holds the older snapshot, and a zombie's snapshot that landed as the claim moved is current until it
is rolled back. Neither is the run's commit, and a run whose claim is gone is not either.
"""

from __future__ import annotations

import dataclasses

import pytest

from airflow_provider_batchinfer import rundir
from airflow_provider_batchinfer.contract import ManifestError
from airflow_provider_batchinfer.markers import read_valid_manifest
from airflow_provider_batchinfer.runtime.table_commit import commit_table
from airflow_provider_batchinfer.stage import Stage
from airflow_provider_batchinfer.tables.catalog import embedded_catalog
from airflow_provider_batchinfer.tables.read import CATALOG_OPTION
from tests.unit.test_iceberg_commit import TABLE, written_attempt


@pytest.fixture
def committed(tmp_path):
    """A run committed into the table by attempt t01first; its claim directory; how to read it."""
    props = embedded_catalog(str(tmp_path / "stage"), str(tmp_path))
    job, data_dir, manifest = written_attempt(tmp_path, props, "day1", "t01first", range(20))
    commit_table(job, data_dir, manifest)
    location = f"iceberg://{TABLE}/day1"

    def read():
        return read_valid_manifest(location, {CATALOG_OPTION: props}, verify_checksums=True)

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
    claim_dir.clear_run_directory()  # what a newer try's clean-up does before it claims
    with pytest.raises(
        ManifestError, match=r"committed by attempt t01first under the claim .*_job.json, which is gone"
    ):
        read()
