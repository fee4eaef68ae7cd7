"""The model cache on a node: a directory only this user may change (``store/private_dir.py``).

A model is checked and then loaded (imported, unpickled); whoever can write the directory in
between can swap it. So the cache is private, created 0700, and a directory that is a symbolic link,
belongs to another user or is writable by others is refused, never followed or repaired. The levels
below the cache root may be readable by others (copies keep their files' modes), never writable.
"""

from __future__ import annotations

import os
from pathlib import Path

from airflow_provider_batchinfer.registry.versions import RegistryError
from airflow_provider_batchinfer.store import private_dir as private


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
