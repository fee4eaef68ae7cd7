"""Location strings and their rules, before anything is opened: joining and resolving them below a
root, refusing paths that climb out of it, one spelling per location, a run key per Airflow run.

Everything here is a pure string function, so the stage, the S3 layer, the claim and marker checks
and the readers below the connection's roots all build on it without importing each other.
"""

from __future__ import annotations

import hashlib
import posixpath
import re

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class StageError(RuntimeError):
    """A stage location is unusable or a run directory is in a state we must not touch."""


def sanitize_run_key(run_id: str, max_len: int = 120) -> str:
    """Turn an Airflow run_id into one safe path segment, stable across tries of the same run.

    ``manual__2026-11-23T01:18:23.440778+00:00`` holds ``:`` and ``+``, which object stores and
    shells mangle. Replaced characters could make two run_ids collide, so whenever the text changes
    a short hash of the original is appended: distinct run_ids always get distinct directories.
    """
    if not isinstance(run_id, str) or not run_id.strip():
        raise StageError(f"cannot derive a run key from run_id={run_id!r}")
    clean = _UNSAFE.sub("_", run_id.strip()).strip("._-") or "run"
    if clean != run_id or len(clean) > max_len:
        digest = hashlib.sha1(run_id.encode("utf-8")).hexdigest()[:8]
        clean = f"{clean[: max_len - 9]}-{digest}"
    return clean


def check_relative_path(path: str, what: str) -> str:
    """Refuse ``..`` segments and absolute paths where a path must stay below a root."""
    if not isinstance(path, str) or not path:
        raise StageError(f"{what} must be a non-empty path, got {path!r}")
    parts = path.replace("\\", "/").split("/")
    if ".." in parts:
        raise StageError(f"{what}={path!r} contains '..'; paths may not climb out of their root")
    return path


def is_uri(location: str) -> bool:
    return "://" in location


def resolve_location(location: str, root: str | None) -> str:
    """Absolute paths and URIs stay as they are; a relative path is placed under ``root``.

    Every form refuses ``..`` segments, so a templated value cannot climb out of the stage root.
    """
    check_relative_path(location, "location")
    if is_uri(location) or location.startswith("/"):
        return location.rstrip("/") or "/"
    if not root:
        raise StageError(
            f"location {location!r} is relative but no stage root is configured; give an absolute path or "
            "URI, or set stage_root in the batchinfer connection's extras"
        )
    return join(root, location)


def join(location: str, *parts: str) -> str:
    for part in parts:
        check_relative_path(part, "path segment")
    if is_uri(location):
        scheme, rest = location.split("://", 1)
        return f"{scheme}://{posixpath.join(rest.rstrip('/'), *parts)}"
    return posixpath.join(location, *parts)


def normalized_location(location: str) -> str:
    """One spelling per location: no ``file://``, no trailing or doubled slashes, ``s3a`` as ``s3``."""
    if location.startswith("file://"):
        location = location[len("file://") :]
    if "://" in location:
        scheme, rest = location.split("://", 1)
        scheme = "s3" if scheme.lower() == "s3a" else scheme.lower()
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
    return posixpath.normpath(location)
