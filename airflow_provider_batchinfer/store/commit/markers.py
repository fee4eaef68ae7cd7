"""Reading and checking committed markers: the manifest against the files it lists.

A ``_SUCCESS`` is trusted only when it is a valid :class:`~airflow_provider_batchinfer.contract.Manifest`
(one schema for the validator and every reader) and describes the files beside it: each listed file
present with its size and a Parquet footer holding its row count; with ``verify_checksums`` also
the sha256 of its bytes. ``read_directory_rows`` hashes each file as it reads it. Reading any
committed run (a run directory or an Iceberg table's snapshot) starts in ``store/committed.py``.

Checking every part costs requests in proportion to the parts (one or two per part on S3), so a
reader that looks at the same marker again (a sensor's next poke, another sensor or trigger on the
same run in the same process) passes a :class:`Verdicts` cache: once a marker's files checked out,
the same marker bytes at the same location, over the same listing (names, sizes, modification
times), skip the footers and the hashing. A later look costs the marker's read and one listing of
the directory, whatever the number of parts, and still notices a part removed, resized or rewritten.
The cache lives in the process only; a verdict on storage could be planted beside the files it
vouches for. Storage layer: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, FileEntry, Manifest, ManifestError
from airflow_provider_batchinfer.store.commit.fence import CLAIM_METADATA
from airflow_provider_batchinfer.store.commit.part_bytes import compare_sha256, footer_rows, hashed_rows, sha256_of
from airflow_provider_batchinfer.store.commit.verdicts import Verdicts
from airflow_provider_batchinfer.store.locations import check_relative_path, join, normalized_location
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa


# --- the manifest against the files --------------------------------------------------------------------
ManifestLike = Manifest | Mapping[str, Any]
_FORMAT_1 = "batchinfer.manifest/1"
#: (size, modification time in ns or None) of each file below a run directory, by relative name
Listing = Mapping[str, tuple[int, int | None]]


def as_manifest(manifest: ManifestLike, where: str = "manifest") -> Manifest:
    """A typed manifest from a :class:`Manifest` or its dict (an XCom value), validated on read."""
    return manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest, where)


def file_sha256(stage: Stage) -> str:
    """The sha256 of one file's bytes, read in chunks."""
    with stage._io("read"), stage.fs.open_input_stream(stage.path) as f:
        return sha256_of(f)


def _footer_rows(stage: Stage, size: int) -> int:
    """Rows in a Parquet file's footer, read from its last bytes only (a ranged read on S3). A file
    overwritten with anything but Parquet has no footer and raises ManifestError."""
    with stage._io("read the Parquet footer of"), stage.fs.open_input_file(stage.path) as f:
        return footer_rows(stage.location, size, f)


def _hashed_rows(stage: Stage, size: int) -> tuple[str, int]:
    """The sha256 of a part's bytes and the rows in its footer, from one read of the part: the
    footer comes from the last bytes hashed."""
    with stage._io("read"), stage.fs.open_input_file(stage.path) as f:
        return hashed_rows(stage.location, size, f)


def _no_checksums(where: str, manifest: Manifest) -> ManifestError:
    return ManifestError(
        f"{where} is a {manifest.format} marker and records no checksums, so its files cannot be verified; read it "
        "with verify_checksums=False, or re-run the task to write a marker with checksums"
    )


def _check_listed(run_dir: Stage, entry: FileEntry, present: Listing) -> None:
    """The entry's name and size against the listing: no request."""
    check_relative_path(entry.name, "manifest file name")
    location = f"{run_dir.location}/{entry.name}"
    if entry.name not in present:
        raise ManifestError(f"{location} is listed in {SUCCESS_MARKER} but missing")
    if present[entry.name][0] != entry.size:
        raise ManifestError(f"{location} is {present[entry.name][0]} bytes but {SUCCESS_MARKER} says {entry.size}")


def _check_part(run_dir: Stage, entry: FileEntry, hash_bytes: bool) -> None:
    """The part's footer against its rows, and with ``hash_bytes`` its bytes against its sha256:
    one read of the part either way (its end, or all of it)."""
    location = f"{run_dir.location}/{entry.name}"
    part = run_dir.child(*entry.name.split("/"))
    expected = entry.sha256
    if hash_bytes and expected is None:
        raise ManifestError(f"{location} has no sha256 in {SUCCESS_MARKER}; it cannot be verified")
    digest, rows = _hashed_rows(part, entry.size) if hash_bytes else (None, _footer_rows(part, entry.size))
    if rows != entry.rows:
        raise ManifestError(f"{location} holds {rows} rows but {SUCCESS_MARKER} says {entry.rows}")
    if digest is not None and expected is not None:
        compare_sha256(location, digest, expected)


def verify_contents(run_dir: Stage, manifest: Manifest) -> None:
    """Every listed file's bytes against its sha256 in the manifest: one read of the whole output.
    Raises ManifestError naming the first file that differs (or a marker with no checksums)."""
    if manifest.format == _FORMAT_1:
        raise _no_checksums(f"{run_dir.location}/{SUCCESS_MARKER}", manifest)
    for entry in manifest.files + manifest.error_files:
        check_relative_path(entry.name, "manifest file name")
        location = f"{run_dir.location}/{entry.name}"
        if entry.sha256 is None:
            raise ManifestError(f"{location} has no sha256 in {SUCCESS_MARKER}; it cannot be verified")
        compare_sha256(location, file_sha256(run_dir.child(*entry.name.split("/"))), entry.sha256)


def validate_manifest(
    run_dir: Stage,
    manifest: ManifestLike,
    *,
    verify_checksums: bool = False,
    read_footers: bool = True,
    listing: Listing | None = None,
    claim_token: str | None = None,
) -> None:
    """Check that a manifest describes the files beside it: its schema (``Manifest.from_dict``), its
    counts, the attempt that committed it against the directory's claim (``claim_token``: the
    claim's ETag an S3 marker records it was committed under, which must then be there unchanged:
    :func:`check_claim`), and for every listed file
    (outputs and dead letters) its name, size and Parquet footer (row count); with
    ``verify_checksums`` also each file's sha256, from the same read of the file. Names and sizes
    come from one listing (``listing``, when the caller took it already) and are checked for every
    file before any file is read. ``read_footers=False`` checks names and sizes alone: for a
    marker whose files this process already verified, so a later look makes no request per part.
    Raises ManifestError naming the first problem (a StageError for a name that climbs out of the
    run directory)."""
    where = f"{run_dir.location}/{SUCCESS_MARKER}"
    manifest = as_manifest(manifest, where)
    if normalized_location(manifest.run_dir) != normalized_location(run_dir.location):
        # readers (committed_files, read_committed, publish) open manifest.run_dir: a marker naming
        # another directory would send them to files nobody checked here
        raise ManifestError(
            f"{where} was written for the run directory {manifest.run_dir}, not {run_dir.location}; a marker only "
            "vouches for the directory it was committed in. Read the output where it was written, or re-run the task"
        )
    manifest.check_counts(where)
    if verify_checksums and manifest.format == _FORMAT_1:
        raise _no_checksums(where, manifest)
    present = _list_run_dir(run_dir) if listing is None else listing
    if manifest.table is None:  # a table run's claim is in its claim directory (tables.read)
        check_claim(
            run_dir,
            manifest.job.attempt,
            where,
            expected=claim_token is not None,
            version=claim_token,
            present=JOB_SPEC_FILE in present,
        )
    entries = manifest.files + manifest.error_files
    for entry in entries:
        _check_listed(run_dir, entry, present)
    if read_footers or verify_checksums:
        for entry in entries:
            _check_part(run_dir, entry, verify_checksums)


def _list_run_dir(run_dir: Stage) -> dict[str, tuple[int, int | None]]:
    """Every file below a run directory: (size, modification time in ns) by name relative to it, from
    one recursive listing (on S3 one request per 1,000 keys); empty when there is no such directory."""
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(run_dir.path, recursive=True, allow_not_found=True)
    try:
        with run_dir._io("list"):
            items = run_dir.fs.get_file_info(selector)
    except NotADirectoryError:  # a file where the directory should be: it holds none of the files
        return {}
    prefix = run_dir.path.rstrip("/") + "/"
    return {
        (item.path[len(prefix) :] if item.path.startswith(prefix) else item.path): (item.size, item.mtime_ns)
        for item in items
        if item.type == pafs.FileType.File
    }


def check_claim(
    claim_dir: Stage,
    attempt: str,
    where: str,
    *,
    expected: bool = False,
    version: str | None = None,
    present: bool | None = None,
) -> None:
    """The attempt that committed (``attempt``) against the claim in ``claim_dir`` (its
    ``_job.json``). An S3 zombie's marker is visible between its conditional write and its
    withdrawal, beside a newer claim or none (a revoke deletes the claim first); an Iceberg snapshot
    that landed as the claim moved, until its rollback (``docs/commit-protocol.md``).

    ``expected``: the commit says it was made under a claim (an S3 marker records the claim's ETag,
    ``version``, which must be the claim's now; every Iceberg run has a claim directory), so a
    missing claim fails. Otherwise it is no finding: on local disk the protocol never leaves a
    marker without its claim, and an S3 marker from before markers recorded it cannot tell.
    ``present``: whether the caller's listing shows the claim (None: read it to find out)."""
    claim = claim_dir.child(JOB_SPEC_FILE)
    found = None if present is False else _read_object(claim, with_version=version is not None)
    if found is None:
        if not expected:
            return
        raise ManifestError(
            f"{where} was committed by attempt {attempt} under the claim {claim.location}, which is gone: a newer "
            "try is claiming or clearing the run, or this is a stopped attempt's commit that was never withdrawn. "
            "Wait for the newer try to commit, or re-run the task"
        )
    data, now, _ = found
    try:
        claimed = json.loads(data).get("attempt")
    except (ValueError, AttributeError) as exc:
        raise ManifestError(f"{where}: the run's claim {claim.location} cannot be read ({exc})") from exc
    if claimed != attempt:
        raise ManifestError(
            f"{where} was committed by attempt {attempt}, but the run directory is claimed by attempt "
            f"{claimed}: a newer try owns it and has not committed. Wait for that try, or re-run the task"
        )
    if version is not None and now is not None and now != version:
        raise ManifestError(
            f"{where} was committed under version {version} of the claim {claim.location}, but it is {now} now: "
            "the claim was written again after the commit. Re-run the task that writes this run"
        )


def _seal(manifest: Manifest, listing: Listing) -> str:
    """What a verdict holds over: the name, size and modification time of every listed file. A part
    rewritten after the verdict (even with the same size) has another time, so it is checked again."""
    seen = [[entry.name, *listing.get(entry.name, (None, None))] for entry in manifest.files + manifest.error_files]
    return hashlib.sha256(json.dumps(seen).encode()).hexdigest()


def _read_marker(marker: Stage) -> bytes | None:
    """The marker's bytes, or None while there is none: no separate existence check (a request)."""
    try:
        return marker.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _read_object(stage: Stage, with_version: bool) -> tuple[bytes, str | None, Mapping[str, str]] | None:
    """A marker's or claim's bytes, and on S3 when asked its ETag and user metadata from the same
    request (``None``, ``{}`` otherwise); None while there is none."""
    if not with_version or stage.fs.type_name != "s3":
        data = _read_marker(stage)
        return None if data is None else (data, None, {})
    from airflow_provider_batchinfer.store import s3_objects

    found = s3_objects.get(stage)
    return None if found is None else (found.body, found.etag, found.metadata)


def read_directory_manifest(
    location: str,
    storage_options: dict[str, Any] | None = None,
    *,
    verify_checksums: bool = False,
    verdicts: Verdicts | None = None,
) -> Manifest | None:
    """The validated manifest of a run directory, or None while it has no marker. With
    ``verdicts``, files already checked for these very marker bytes, in either mode for
    ``verify_checksums=False`` and with checksums for ``True``, are not read again: the look costs
    the marker's read and one listing (names, sizes and times against the verdict's seal)."""
    run_dir = Stage.open(location, storage_options)
    marker = run_dir.child(SUCCESS_MARKER)
    found = _read_object(marker, with_version=True)
    if found is None:
        return None
    data, _, metadata = found
    token = metadata.get(CLAIM_METADATA)  # the claim an S3 marker was committed under
    manifest = Manifest.from_json(data, marker.location)
    if verdicts is None:
        validate_manifest(run_dir, manifest, verify_checksums=verify_checksums, claim_token=token)
        return manifest
    key = verdicts.key(location, data, storage_options, verify_checksums=verify_checksums)
    hashed = verdicts.key(location, data, storage_options, verify_checksums=True)  # also vouches for footers
    with verdicts.first_look(key):
        listing = _list_run_dir(run_dir)
        seal = _seal(manifest, listing)
        known = verdicts.holds(key, seal) or verdicts.holds(hashed, seal)
        validate_manifest(
            run_dir,
            manifest,
            verify_checksums=verify_checksums and not known,
            read_footers=not known,
            listing=listing,
            claim_token=token,
        )
        if not known:
            verdicts.add(key, seal)
    return manifest


def committed_files(manifest: ManifestLike) -> list[str]:
    """Full locations of the files a manifest commits: what ``publish`` should read, and nothing else."""
    m = as_manifest(manifest)
    return [join(m.run_dir, *entry.name.split("/")) for entry in m.files]


def dead_letter_files(manifest: ManifestLike) -> list[str]:
    """Full locations of the dead-lettered rows a manifest lists (``_errors/``): ids + error message."""
    m = as_manifest(manifest)
    return [join(m.run_dir, *entry.name.split("/")) for entry in m.error_files]


def read_directory_rows(
    manifest: ManifestLike,
    storage_options: dict[str, Any] | None = None,
    columns: list[str] | None = None,
    verify_checksums: bool = True,
) -> pa.Table:
    """The rows of a run directory's committed files (``committed.read_committed``), hashed and parsed
    from the same bytes when ``verify_checksums``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    m = as_manifest(manifest)
    run_dir = Stage.open(m.run_dir, storage_options)
    if not m.files:
        raise ManifestError(f"{run_dir.location}/{SUCCESS_MARKER} commits no files; there is nothing to read")
    if verify_checksums and m.format == _FORMAT_1:
        raise _no_checksums(f"{run_dir.location}/{SUCCESS_MARKER}", m)
    tables = []
    for entry in m.files:
        check_relative_path(entry.name, "manifest file name")
        data = run_dir.child(*entry.name.split("/")).read_bytes()
        location = f"{run_dir.location}/{entry.name}"
        if len(data) != entry.size:
            raise ManifestError(f"{location} is {len(data)} bytes but {SUCCESS_MARKER} says {entry.size}")
        if verify_checksums:
            if entry.sha256 is None:
                raise ManifestError(f"{location} has no sha256 in {SUCCESS_MARKER}; it cannot be verified")
            compare_sha256(location, hashlib.sha256(data).hexdigest(), entry.sha256)
        try:
            tables.append(pq.read_table(pa.BufferReader(data), columns=columns))
        except (ValueError, OSError) as exc:
            raise ManifestError(
                f"{location} is not a readable Parquet file ({exc}); re-run the task that wrote it"
            ) from exc
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
