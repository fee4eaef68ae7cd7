"""A version's files on the node that uses them: fetched once per node, re-hashed before use."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.versions import (
    MODEL_MANIFEST,
    RegistryError,
    TamperedModelError,
    hash_tree,
    tree_digest,
)
from airflow_provider_batchinfer.stage import Stage

MODEL_CACHE_ENV = "BATCHINFER_MODEL_CACHE"


def model_cache_dir(cache_dir: str | None = None) -> Path:
    """Where object-store models are cached on this node: ``$BATCHINFER_MODEL_CACHE``, else
    ``<tmp>/batchinfer-models``."""
    return Path(cache_dir or os.environ.get(MODEL_CACHE_ENV) or Path(tempfile.gettempdir()) / "batchinfer-models")


def cached_copy(cache_root: Path, location: str, sha256: str) -> Path:
    """The cache directory of the version at ``location``: ``<root>/<sha256>/<hash of location>``.

    The sha256 covers a version's files, not its manifest: two versions logged from one source file
    (two classes of one ``models.py``) have the same sha256 and load different classes. Keyed by
    content alone, the second would be served the first one's ``MODEL.json`` and load the wrong
    class; one directory per location under the content hash keeps each version's own manifest.
    """
    return cache_root / sha256 / hashlib.sha256(location.encode()).hexdigest()[:16]


def fetch_version(
    uri: str,
    sha256: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    verify: bool = True,
) -> tuple[Path, dict[str, Any] | None]:
    """The local directory of the model version at ``uri`` (and, with ``verify``, its re-hashed manifest).

    A local registry is used in place. An object-store one is downloaded into this node's cache
    under the pinned ``sha256`` and its location (:func:`cached_copy`): this runs in every Ray
    actor, so each node of a multi-node cluster fetches the model for itself, once, whichever node
    the job's driver is on. Concurrent replicas on one node each download into a private directory
    and publish it with one atomic rename; the loser of the race discards its copy. A cached copy that fails verification (a disk fault, a
    hand edit) is dropped and downloaded again once; if the fresh copy fails too, the registry
    itself holds a changed model and the error says so.
    """
    import pyarrow.fs as pafs

    source = Stage.open(uri, storage_options)
    if isinstance(source.fs, pafs.LocalFileSystem):
        path = Path(source.path)
        return path, (verify_local_copy(path, sha256) if verify else None)
    cache = cached_copy(model_cache_dir(cache_dir), source.location, sha256)
    for fresh in (False, True):
        if fresh or not (cache / MODEL_MANIFEST).exists():
            _download(source, cache, replace=fresh)
        if not verify:
            return cache, None
        try:
            return cache, verify_local_copy(cache, sha256)
        except TamperedModelError as exc:
            if fresh:
                raise TamperedModelError(
                    f"{exc} (downloaded just now from {source.location}: the registry's copy "
                    "changed after it was logged)"
                ) from exc
    raise AssertionError("unreachable")


def _download(source: Stage, cache: Path, replace: bool) -> None:
    import pyarrow.fs as pafs

    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
    try:
        with source._io("download"):
            pafs.copy_files(
                source.path, str(tmp), source_filesystem=source.fs, destination_filesystem=pafs.LocalFileSystem()
            )
        if not (tmp / MODEL_MANIFEST).exists():
            raise RegistryError(f"{source.location} holds no {MODEL_MANIFEST}; it is not a logged model version")
        if replace and cache.exists():
            stale = cache.with_name(f".{cache.name}-stale-{os.getpid()}-{tmp.name}")
            try:
                os.replace(cache, stale)
                shutil.rmtree(stale, ignore_errors=True)
            except FileNotFoundError:
                pass
        try:
            os.replace(tmp, cache)
        except OSError:  # another replica on this node published the same content first
            if not (cache / MODEL_MANIFEST).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def verify_local_copy(path: Path, expected_sha256: str | None = None) -> dict[str, Any]:
    """Re-hash every file of a version and compare with its manifest (and the pinned digest).

    Raises TamperedModelError naming the first file that was changed, added or removed. Runs in the
    operator before launch and on every Ray worker before the model is loaded.
    """

    manifest_path = path / MODEL_MANIFEST
    if not manifest_path.exists():
        raise RegistryError(f"{path} holds no {MODEL_MANIFEST}; it is not a logged model version")
    manifest = json.loads(manifest_path.read_text())
    recorded = manifest["files"]
    actual = hash_tree(path)
    for rel in sorted(set(recorded) | set(actual)):
        if rel not in actual:
            raise TamperedModelError(
                f"model file {path / rel} was removed after the model was logged; re-log the model"
            )
        if rel not in recorded:
            raise TamperedModelError(f"model file {path / rel} was added after the model was logged; re-log the model")
        if actual[rel]["sha256"] != recorded[rel]["sha256"]:
            raise TamperedModelError(
                f"model file {path / rel} does not match its recorded sha256 (expected {recorded[rel]['sha256'][:12]}…, "
                f"found {actual[rel]['sha256'][:12]}…): it changed after the model was logged; refusing to use it"
            )
    digest = tree_digest(actual)
    if digest != manifest["sha256"] or (expected_sha256 and digest != expected_sha256):
        raise TamperedModelError(
            f"model at {path} has sha256 {digest[:12]}… but {expected_sha256 or manifest['sha256']} was pinned; refusing to use it"
        )
    return manifest
