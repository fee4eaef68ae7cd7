"""Directories on a node that only this user may change: the model cache.

A model is checked and then loaded (imported, unpickled); whoever can write the directory in
between can swap it. So the cache is created 0700, and a directory that is a symbolic link, belongs
to another user, or is writable by others is refused, never followed or repaired: something may
already be planted in it. One of ours that others can only read is tightened to 0700 (nobody else
could have written into it). The directory it sits in must not let others rename it away either.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from airflow_provider_batchinfer.registry.versions import RegistryError


def _refuse(path: Path, what: str, why: str) -> RegistryError:
    return RegistryError(
        f"{what} {path} {why}; refusing to use it: remove it, or point BATCHINFER_MODEL_CACHE at a "
        "directory of your own"
    )


def check_own_dir(path: Path, what: str = "model cache directory") -> os.stat_result:
    """``path`` is a real directory (not a link), owned by this user, that no one else can write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise _refuse(path, what, "does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, what, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, what, "is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(path, what, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise _refuse(path, what, f"is writable by other users (mode {oct(stat.S_IMODE(st.st_mode))})")
    return st


def _check_parent(parent: Path, what: str) -> None:
    """Others may not rename our directory away: the parent is not writable by them, unless it is
    sticky (``/tmp``), where only an entry's owner may rename it; it is ours or root's."""
    st = os.stat(parent)  # followed: /tmp may be a link to the real one
    if st.st_uid not in (0, os.geteuid()):
        raise _refuse(parent, f"the directory that holds the {what}", f"belongs to uid {st.st_uid}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(parent, f"the directory that holds the {what}", "is writable by other users and not sticky")


def private_dir(path: Path, what: str = "model cache") -> Path:
    """``path``, created 0700 when missing, once it is this user's own (see the module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_parent(path.parent, what)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = check_own_dir(path, what)
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)  # checked above: ours, a directory, no link
    return path
