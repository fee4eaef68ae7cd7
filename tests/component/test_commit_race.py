"""A zombie attempt that stops right after its last check and continues after a newer try took
over: its commit fails and changes nothing, on a local directory, on the S3 server and in an Iceberg
table (``fence``, ``runtime/table_fence``).

The zombie is a real process: the runtime's commit function in a subprocess that stops itself with
SIGSTOP at a named point (``BATCHINFER_TEST_PAUSE_AT``, ``fence.pause_for_test``). While it is
stopped the newer attempt clears the directory, claims it and (mostly) commits, in this process;
then the zombie gets SIGCONT, and the newer attempt's output must be byte for byte what it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, FileEntry, Manifest, part_name
from airflow_provider_batchinfer.store.commit import rundir
from airflow_provider_batchinfer.store.commit.fence import CLAIMS_DIR, PAUSE_ENV
from airflow_provider_batchinfer.store.commit.rundir import clear_run_directory
from airflow_provider_batchinfer.store.committed import read_valid_manifest
from airflow_provider_batchinfer.store.stage import Stage
from tests.runs import OWNER, job_file, manifest_for, parquet_bytes

ROOT = Path(__file__).resolve().parents[2]
# the zombie's state is read from /proc (stopped: "T")
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
NEWER_OWNER = dataclasses.replace(OWNER, try_number=2)
KEY_ID, SECRET = "AKIDFENCETEST", "fence-secret"

# the runtime's commit functions, driven on their own: a run directory, or an Iceberg table
COMMIT_DIR = r"""
import json, sys
from airflow_provider_batchinfer.contract import Manifest
from airflow_provider_batchinfer.runtime.output.commit import commit
from airflow_provider_batchinfer.store.stage import Stage
args = json.loads(sys.argv[1])
commit(Stage.open(args["location"], args["options"]), Manifest.from_json(args["manifest"]))
"""
COMMIT_TABLE = r"""
import json, sys
from airflow_provider_batchinfer.contract import JobFile, Manifest
from airflow_provider_batchinfer.runtime.output.table_commit import commit_table
from airflow_provider_batchinfer.store.stage import Stage
args = json.loads(sys.argv[1])
commit_table(JobFile.from_json(args["job"]), Stage.open(args["location"]), Manifest.from_json(args["manifest"]))
"""


class Zombie:
    """A commit in a subprocess, stopped by itself at ``point``."""

    def __init__(self, script: str, args: dict, point: str, env: dict[str, str] | None = None) -> None:
        environ = {**os.environ, **(env or {}), PAUSE_ENV: point}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(args)],
            cwd=ROOT,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.point = point

    def stopped(self) -> Zombie:
        """Wait until the process stopped itself at its point (or fail with what it said)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(f"the zombie never stopped at {self.point}; exit {self.proc.returncode}: {out}{err}")
            state = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("T", "t"):
                return self
            time.sleep(0.05)
        pytest.fail(f"the zombie did not reach {self.point}")

    def resume(self) -> tuple[int, str]:
        os.kill(self.proc.pid, signal.SIGCONT)
        out, err = self.proc.communicate(timeout=180)
        return self.proc.returncode, out + err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def zombies():
    started: list[Zombie] = []

    def start(*args, **kwargs) -> Zombie:
        started.append(Zombie(*args, **kwargs))
        return started[-1].stopped()

    yield start
    for z in started:
        z.kill()


def contents(stage: Stage) -> dict[str, bytes]:
    """Every file below ``stage``, byte for byte."""
    return {name: stage.child(*name.split("/")).read_bytes() for name, _ in stage.list_files()}


def write_attempt(run: Stage, attempt: str, ids: list[int], owner=OWNER) -> Manifest:
    """Claim ``run`` for ``attempt`` (as the operator does) and write its parts (as its workers do)."""
    rundir.claim(run, job_file(run.location, attempt=attempt, owner=owner))
    entries = []
    for n, chunk in enumerate((ids[: len(ids) // 2], ids[len(ids) // 2 :])):
        data = parquet_bytes(chunk)
        name = part_name(n, attempt)
        run.child(name).write_bytes(data)
        entries.append(FileEntry(name=name, size=len(data), rows=len(chunk), sha256=hashlib.sha256(data).hexdigest()))
    return manifest_for(run.location, tuple(entries), attempt=attempt)


def newer_try(run: Stage, commit: bool) -> Manifest:
    """What the newer try does while the zombie is stopped: OVERWRITE's clean-up (as
    ``rundir.prepare`` does it), its claim, its parts, and unless told otherwise its commit."""
    clear_run_directory(run)
    manifest = write_attempt(run, "t02newer", [10, 11, 12, 13], owner=NEWER_OWNER)
    if commit:
        rundir.commit(run, manifest)
    return manifest


def assert_fenced(rc: int, output: str) -> None:
    assert rc != 0, f"the zombie committed: {output}"
    assert "FencedError: attempt t01zombie is no longer the owner" in output, output


# --- a directory: local disk and the S3 server -----------------------------------------------------------


def s3_run(endpoint: str, bucket: str) -> tuple[Stage, dict, dict[str, str]]:
    options = {"endpoint_url": endpoint, "region": "us-east-1"}
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_EC2_METADATA_DISABLED": "true"}
    run = Stage.open(f"s3://{bucket}/out/run1", {**options, "access_key": KEY_ID, "secret_key": SECRET})
    return run, options, env


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """A run directory on local disk or on the S3 server, with what the zombie needs to open it."""
    if request.param == "local":
        return Stage.open(str(tmp_path / "run1")), None, {}
    endpoint, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    return s3_run(endpoint, bucket)


@pytest.mark.parametrize(
    "point",
    ["marker:checked", "marker:written"],
    ids=["stopped-after-its-check", "stopped-after-its-write"],
)
def test_a_zombie_continued_after_a_newer_try_committed_commits_nothing(store, zombies, point):
    run, options, env = store
    late = write_attempt(run, "t01zombie", [1, 2, 3, 4, 5])
    zombie = zombies(COMMIT_DIR, {"location": run.location, "options": options, "manifest": late.to_json()}, point, env)
    newer = newer_try(run, commit=True)
    before = contents(run)
    assert_fenced(*zombie.resume())
    assert contents(run) == before
    assert read_valid_manifest(run.location, _reader_options(run, options), verify_checksums=True) == newer


def test_a_zombie_continued_after_a_newer_claim_leaves_no_marker(store, zombies):
    """The newer try claimed but has not committed: the zombie's marker must not appear beside its
    claim (local: the write is refused; S3: the zombie's own marker is withdrawn)."""
    run, options, env = store
    late = write_attempt(run, "t01zombie", [1, 2, 3, 4, 5])
    zombie = zombies(
        COMMIT_DIR, {"location": run.location, "options": options, "manifest": late.to_json()}, "marker:checked", env
    )
    newer_try(run, commit=False)
    before = contents(run)
    assert_fenced(*zombie.resume())
    assert contents(run) == before and SUCCESS_MARKER not in before
    assert rundir.read_claim(run).attempt == "t02newer"


def _reader_options(run: Stage, options: dict | None) -> dict | None:
    return None if options is None else {**options, "access_key": KEY_ID, "secret_key": SECRET}


# --- the protocol's own rules ------------------------------------------------------------------------------


def test_a_claim_revokes_the_earlier_token_and_grants_its_own(tmp_path):
    run = Stage.open(str(tmp_path / "run1"))
    write_attempt(run, "t01zombie", [1, 2])
    assert (tmp_path / "run1" / CLAIMS_DIR / "t01zombie").is_dir()
    zombie = rundir.hold(run, "t01zombie")
    rundir.claim(run, job_file(run.location, attempt="t02newer", owner=NEWER_OWNER))
    assert sorted(p.name for p in (tmp_path / "run1" / CLAIMS_DIR).iterdir()) == ["t02newer"]
    with pytest.raises(
        rundir.FencedError, match=r"attempt t01zombie is no longer the owner .* attempt t02newer \(try 2\)"
    ):
        rundir.ensure_held(run, zombie)
    assert CLAIMS_DIR not in {name.split("/")[0] for name, _ in run.list_files()}  # a token is not a file


def test_a_directory_claimed_without_a_token_is_not_committed(tmp_path):
    """``_job.json`` naming the attempt is not enough: without its token (a claim written by other
    means, or one a newer claim revoked) the attempt cannot commit."""
    run = Stage.open(str(tmp_path / "run1"))
    manifest = write_attempt(run, "t01aaaa", [1, 2, 3])
    (tmp_path / "run1" / CLAIMS_DIR / "t01aaaa").rmdir()
    with pytest.raises(rundir.FencedError, match=r"attempt t01aaaa holds no commit token in .*; not committing"):
        rundir.commit(run, manifest)
    assert not (tmp_path / "run1" / SUCCESS_MARKER).exists()


def test_links_planted_as_tokens_are_removed_never_followed(tmp_path):
    """Someone who can write the run directory plants ``_claims`` (or a token) as a symlink to a
    directory of theirs choosing: revoking removes the link and leaves the target as it was."""
    victim = tmp_path / "victim"
    (victim / "t01zombie").mkdir(parents=True)
    (victim / "t01zombie" / "keep.txt").write_text("precious")
    run = Stage.open(str(tmp_path / "run1"))
    write_attempt(run, "t01zombie", [1, 2])
    claims = tmp_path / "run1" / CLAIMS_DIR
    (claims / "t01zombie").rmdir()
    (claims / "t01zombie").symlink_to(victim / "t01zombie")
    rundir.claim(run, job_file(run.location, attempt="t02newer", owner=NEWER_OWNER))
    assert sorted(p.name for p in claims.iterdir()) == ["t02newer"]
    claims.rename(tmp_path / "moved")
    claims.symlink_to(victim)
    rundir.claim(run, job_file(run.location, attempt="t03newest", owner=NEWER_OWNER))
    assert not claims.is_symlink() and sorted(p.name for p in claims.iterdir()) == ["t03newest"]
    assert (victim / "t01zombie" / "keep.txt").read_text() == "precious"


def test_a_claim_removes_a_marker_that_landed_after_prepare(tmp_path):
    """A zombie that committed between the newer try's prepare and its claim (it still held the
    claim then): the claim removes that marker, so it never sits beside the new attempt's parts."""
    run = Stage.open(str(tmp_path / "run1"))
    rundir.commit(run, write_attempt(run, "t01zombie", [1, 2]))
    rundir.claim(run, job_file(run.location, attempt="t02newer", owner=NEWER_OWNER))
    assert not (tmp_path / "run1" / SUCCESS_MARKER).exists()
    assert (tmp_path / "run1" / JOB_SPEC_FILE).exists()


def test_on_s3_only_the_claims_holder_replaces_a_marker_it_finds(s3_server, s3_bucket):
    """A marker at the key when the holder commits can only be a zombie's: the holder replaces it
    (If-Match on its ETag). A zombie that finds the holder's marker never replaces it."""
    run, _, _ = s3_run(s3_server, s3_bucket)
    late = write_attempt(run, "t01zombie", [1, 2])
    zombie = rundir.hold(run, "t01zombie")
    newer = write_attempt(run, "t02newer", [3, 4], owner=NEWER_OWNER)
    run.child(SUCCESS_MARKER).write_bytes(late.to_json().encode())  # the zombie's marker, landed unchecked
    rundir.commit(run, newer)
    assert Manifest.from_json(run.child(SUCCESS_MARKER).read_bytes()) == newer
    from airflow_provider_batchinfer.store.commit.claims import claims_for
    from airflow_provider_batchinfer.store.commit.fence import ClaimLost

    with pytest.raises(ClaimLost, match="a marker is there already and the claim moved"):
        claims_for(run).write_marker(zombie, late.to_json().encode())
    assert Manifest.from_json(run.child(SUCCESS_MARKER).read_bytes()) == newer


# --- an Iceberg table ---------------------------------------------------------------------------------------


@pytest.fixture
def catalog_props(tmp_path):
    from airflow_provider_batchinfer.store.iceberg.catalog import embedded_catalog

    return embedded_catalog(str(tmp_path / "stage"), str(tmp_path))


def table_state(props: dict) -> tuple[int, dict[str, str], list[int]]:
    from airflow_provider_batchinfer.store.iceberg.catalog import open_catalog
    from tests.iceberg_support import data_files
    from tests.unit.test_iceberg_commit import TABLE

    table = open_catalog(props).load_table(TABLE)
    ids = sorted(table.scan().to_arrow().column("ticket_id").to_pylist())
    return table.current_snapshot().snapshot_id, data_files(table), ids


@pytest.mark.parametrize("newer_commits", [True, False], ids=["newer-committed", "newer-only-claimed"])
def test_a_zombie_iceberg_overwrite_never_replaces_the_newer_try(tmp_path, catalog_props, zombies, newer_commits):
    from airflow_provider_batchinfer.runtime.output.table_commit import commit_table
    from tests.unit.test_iceberg_commit import written_attempt

    commit_table(*written_attempt(tmp_path, catalog_props, "day1", "t00first", range(100)))
    first = table_state(catalog_props)
    job, data_dir, manifest = written_attempt(tmp_path, catalog_props, "day1", "t01zombie", range(50), "overwrite")
    args = {"job": job.to_json(), "location": data_dir.location, "manifest": manifest.to_json()}
    zombie = zombies(COMMIT_TABLE, args, "table:checked")
    newer = written_attempt(tmp_path, catalog_props, "day1", "t02newer", range(200, 230), "overwrite")
    if newer_commits:
        commit_table(*newer)
    before = table_state(catalog_props)
    rc, output = zombie.resume()
    assert_fenced(rc, output)
    if newer_commits:
        assert table_state(catalog_props) == before
        assert before[2] == list(range(200, 230))
    else:  # its snapshot landed as the claim moved, and was rolled back
        assert "was rolled back" in output, output
        assert table_state(catalog_props) == first and first[2] == list(range(100))
