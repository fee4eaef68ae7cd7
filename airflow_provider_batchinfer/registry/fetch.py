"""A version's files on the node that uses them: fetched once per node, re-hashed before use.

The node's model cache is a directory only this user may change (``store/private_dir.py``): a
model is checked and then loaded (imported, unpickled), and whoever can write the directory in
between can swap it. So the cache is private, created 0700, and a directory that is a symbolic link,
belongs to another user or is writable by others is refused, never followed or repaired. The levels
below the cache root may be readable by others (copies keep their files' modes), never writable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.digest import check_version
from airflow_provider_batchinfer.registry.versions import (
    MODEL_MANIFEST,
    RegistryError,
    TamperedModelError,
    hash_tree,
)
from airflow_provider_batchinfer.store import private_dir as private
from airflow_provider_batchinfer.store.stage import Stage

MODEL_CACHE_ENV = "BATCHINFER_MODEL_CACHE"


def _refusal(what: str, why: object) -> RegistryError:
    return RegistryError(
        f"{what} {why}; refusing to use it: remove it, or point BATCHINFER_MODEL_CACHE at a directory of your own"
    )


def check_own_dir(path: Path, what: str = "model cache directory") -> os.stat_result:
    """``path`` is a real directory (not a link), owned by this user, that no one else can write."""
    try:
        return private.check(path, others_may_read=True)
    except FileNotFoundError:
        raise _refusal(what, f"{path} does not exist") from None
    except private.UnsafeDirectory as exc:
        raise _refusal(what, exc) from None


def private_dir(path: Path, what: str = "model cache") -> Path:
    """``path``, created 0700 when missing, once it is this user's own; one of ours that others
    could only read (made by an older provider) is tightened to 0700."""
    try:
        return private.ensure(path, tighten=True)
    except private.UnsafeDirectory as exc:
        raise _refusal(what, exc) from None


def model_cache_dir(cache_dir: str | None = None) -> Path:
    """Where object-store models are cached on this node: ``$BATCHINFER_MODEL_CACHE``, else
    ``<tmp>/batchinfer-models``; created 0700, and refused when another user could change what is in
    it (:func:`private_dir`): a model is checked there and then loaded from there."""
    return private_dir(
        Path(cache_dir or os.environ.get(MODEL_CACHE_ENV) or Path(tempfile.gettempdir()) / "batchinfer-models")
    )


def cached_copy(cache_root: Path, location: str, sha256: str) -> Path:
    """The cache directory of the version at ``location``: ``<root>/<sha256>/<hash of location>``.

    A version logged in the files-only digest format has a sha256 that covers its files, not its
    manifest: two such versions logged from one source file (two classes of one ``models.py``) have
    the same sha256 and load different classes. Keyed by content alone, the second would be served
    the first one's ``MODEL.json``; one directory per location under the hash keeps each version's own.
    """
    return cache_root / sha256 / hashlib.sha256(location.encode()).hexdigest()[:16]


def fetch_version(
    uri: str,
    sha256: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    verify: bool = True,
) -> tuple[Path, dict[str, Any] | None]:
    """The node-local directory of the model version at ``uri`` (and, with ``verify``, its re-hashed manifest).

    Every registry, local or object-store, is copied into this node's private cache under the pinned
    ``sha256`` and its location (:func:`cached_copy`), and the copy is hashed there: what a loader
    reads is then the bytes that were hashed, never a registry path that a writer could change
    between the hash and the load. This runs in every Ray actor (and in every node-side stage of the
    vLLM engine, ``runtime/model/llm.py``), so each node of a multi-node cluster fetches the model for
    itself, once, whichever node the job's driver is on. Concurrent replicas on one node each copy
    into a private directory and publish it with one atomic rename; the loser of the race discards
    its copy. A cached copy that fails verification (a disk fault, a hand edit) is dropped and
    copied again once; if the fresh copy fails too, the registry itself holds a changed model and
    the error says so.
    """
    import pyarrow.fs as pafs

    source = Stage.open(uri, storage_options)
    local = isinstance(source.fs, pafs.LocalFileSystem)
    name, version = source.location.rstrip("/").rsplit("/", 2)[-2:]  # <registry>/<name>/<version>
    cache = cached_copy(model_cache_dir(cache_dir), source.location, sha256)

    def check(copy: Path) -> dict[str, Any] | None:
        return verify_local_copy(copy, sha256, name=name, version=version) if verify else None

    _check_cached(cache)
    if (cache / MODEL_MANIFEST).exists():
        try:
            return cache, check(cache)
        except TamperedModelError:  # a disk fault or a hand edit of the cached copy: copied again
            _discard(cache)
    try:
        return _download(source, cache, check)
    except TamperedModelError as exc:
        raise TamperedModelError(
            f"{exc} ({'copied' if local else 'downloaded'} just now from {source.location}: the registry's "
            "copy changed after it was logged)"
        ) from exc


def _check_cached(cache: Path) -> None:
    """The levels of a cached copy below the (checked) cache root are this user's own directories,
    never links: a link would be followed to whatever it points at, after the check."""
    for level in (cache.parent, cache):
        if os.path.lexists(level):
            check_own_dir(level, "cached model directory")


def _discard(cache: Path) -> None:
    stale = cache.with_name(f".{cache.name}-stale-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.replace(cache, stale)
        shutil.rmtree(stale, ignore_errors=True)
    except FileNotFoundError:
        pass


def _download(
    source: Stage, cache: Path, check: Callable[[Path], dict[str, Any] | None]
) -> tuple[Path, dict[str, Any] | None]:
    """Copy the version into a private directory beside ``cache``, ``check`` it there, and only then
    publish it at ``cache`` with one rename: a copy that fails its check is never where a loader looks."""
    import pyarrow.fs as pafs

    cache.parent.mkdir(parents=True, exist_ok=True)
    _check_cached(cache)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
    try:
        if isinstance(source.fs, pafs.LocalFileSystem):
            _copy_local(Path(source.path), tmp)
        else:
            with source._io("download"):
                pafs.copy_files(
                    source.path, str(tmp), source_filesystem=source.fs, destination_filesystem=pafs.LocalFileSystem()
                )
        if not (tmp / MODEL_MANIFEST).exists():
            raise RegistryError(f"{source.location} holds no {MODEL_MANIFEST}; it is not a logged model version")
        manifest = check(tmp)
        try:
            os.replace(tmp, cache)
        except OSError:  # another replica on this node published the same content first: check that one
            if not (cache / MODEL_MANIFEST).exists():
                raise
            _check_cached(cache)
            manifest = check(cache)
        return cache, manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_local(root: Path, dest: Path) -> None:
    """Copy a local registry's version into ``dest`` as regular files; a link is refused, never
    followed (what it points to can change after the copy is hashed, and a version holds none)."""
    if not root.is_dir() or root.is_symlink():
        raise RegistryError(f"{root} is not a model version directory; check the registry root and the version name")
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        target = dest / here.relative_to(root)
        target.mkdir(exist_ok=True)
        for entry in sorted([*dirnames, *filenames]):
            path = here / entry
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise TamperedModelError(
                    f"model file {path} is a symbolic link; a model version holds regular files only, never links"
                )
            if stat.S_ISREG(mode):
                shutil.copyfile(path, target / entry, follow_symlinks=False)
            elif not stat.S_ISDIR(mode):
                raise TamperedModelError(f"model file {path} is not a regular file")


def verify_local_copy(
    path: Path, expected_sha256: str | None = None, *, name: str | None = None, version: str | None = None
) -> dict[str, Any]:
    """Re-hash every file of a version and check it and its manifest against the digest (and the
    pinned one): ``registry/digest.py``.

    ``name``/``version``: where the version is stored (default: the last two parts of ``path``, a
    registry's ``<name>/<version>``); its manifest must name the same, and a content name must be
    its digest. Raises TamperedModelError naming the first file that was changed, added, removed or
    linked, or the ``MODEL.json`` field that was edited. Runs in the operator before launch and on
    every Ray worker before the model is loaded.
    """

    manifest_path = path / MODEL_MANIFEST
    if manifest_path.is_symlink():
        raise TamperedModelError(f"{manifest_path} is a symbolic link; refusing to follow it")
    if not manifest_path.exists():
        raise RegistryError(f"{path} holds no {MODEL_MANIFEST}; it is not a logged model version")
    manifest = json.loads(manifest_path.read_text())
    recorded = manifest.get("files")
    if not isinstance(recorded, dict) or not all(isinstance(entry, dict) for entry in recorded.values()):
        raise TamperedModelError(f"{manifest_path} does not record its files; refusing to use it")
    actual = hash_tree(path)
    for rel in sorted(set(recorded) | set(actual)):
        if rel not in actual:
            raise TamperedModelError(
                f"model file {path / rel} was removed after the model was logged; re-log the model"
            )
        if rel not in recorded:
            raise TamperedModelError(f"model file {path / rel} was added after the model was logged; re-log the model")
        if actual[rel]["sha256"] != recorded[rel].get("sha256"):
            raise TamperedModelError(
                f"model file {path / rel} does not match its recorded sha256 (expected "
                f"{str(recorded[rel].get('sha256'))[:12]}…, found {actual[rel]['sha256'][:12]}…): it changed after "
                "the model was logged; refusing to use it"
            )
    if name is None and version is None:
        name, version = path.parent.name, path.name
    check_version(manifest, str(path), actual, name=name, version=version, expected_sha256=expected_sha256)
    return manifest
