"""Where a reader of committed runs may read: below the connection's roots, in their schemes.

A run's XCom (its ``output_location``), the manifest found there and an Iceberg snapshot's summary
are written by a DAG's code, a job, or anyone who can commit to the connection's catalog, so none of
them may choose what the api-server, a sensor or a triggerer opens. A location is placed below one
of the connection's roots (its ``stage_root``, ``registry_root``, and for table reads its Iceberg
warehouse) by string checks alone, before anything is opened; the reader then opens it *from that
root*, with the filesystem the connection builds for the root, so nothing in the location (a scheme
the connection does not configure, an ``endpoint_override`` in a query) can send a request anywhere
else or pick up the process's ambient credentials. Local paths are checked again after symlinks are
resolved. Shared by the UI (``ui/manifests.py``) and the table reader (``store/iceberg/read.py``); imports
neither Airflow nor Ray, and is unit-tested as plain strings.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from airflow_provider_batchinfer.store.locations import StageError, check_relative_path, is_uri, normalized_location
from airflow_provider_batchinfer.store.stage import Stage

__all__ = ["Placed", "Refused", "Roots", "check_local", "open_placed", "place", "shown"]

#: the connection's roots by the name the connection gives each (``stage_root``, ``registry_root``, ...)
Roots = Mapping[str, str]


class Refused(StageError):
    """A location no reader opens: outside the connection's roots, or not a plain location. A
    StageError, so a sensor or trigger fails for good (waiting does not move a location); the run
    page shows the message."""


@dataclass(frozen=True)
class Placed:
    """A location below one of the connection's roots: the root as the connection spells it, and
    the path segments below it."""

    root: str
    parts: tuple[str, ...]


def _split(location: str) -> tuple[str, str]:
    """``(scheme, path)`` of a normalized location; local paths have the scheme ``file``."""
    normal = normalized_location(location)
    if "://" in normal:
        scheme, path = normal.split("://", 1)
        return scheme, path.strip("/")
    return "file", normal


def shown(roots: Roots) -> str:
    """The roots as a message names them: ``stage_root /srv/stage, registry_root s3://lake/registry``."""
    return ", ".join(f"{name} {root}" for name, root in roots.items() if root) or "none configured"


def place(location: object, roots: Roots) -> Placed:
    """The root ``location`` lies below and its segments under it; :class:`Refused` (naming the
    location, the roots and why) for a location that is not a plain absolute path or URI, climbs
    with ``..``, carries a query or fragment, uses a scheme none of the roots use, or lies outside
    every root."""
    named = f"the connection's roots ({shown(roots)})"
    if not isinstance(location, str) or not location.strip():
        raise Refused(f"{location!r} is not a usable location; runs are read only below {named}")
    if any(c in location for c in "\x00?#\\") or any(ord(c) < 32 for c in location):
        raise Refused(
            f"{location!r} holds a query, a fragment, a backslash or a control character, which no location the "
            f"provider writes has; runs are read only below {named}"
        )
    try:
        check_relative_path(location, "the location")
    except StageError as exc:
        raise Refused(f"{exc}; runs are read only below {named}") from None
    if location.startswith("file:/") and not location.startswith("file://"):
        location = location[len("file:") :]  # ``file:/path``: how pyiceberg may spell a local table's files
    if not (is_uri(location) or location.startswith("/")):
        raise Refused(
            f"{location!r} is not an absolute path or URI (a committed run records an absolute one); runs are read "
            f"only below {named}"
        )
    scheme, path = _split(location)
    configured = [(root, *_split(root)) for root in roots.values() if root]
    if not any(root_scheme == scheme for _, root_scheme, _ in configured):
        raise Refused(
            f"{location} is a {scheme}:// location, and the connection configures no root there: runs are read "
            f"only below {named}, with the storage the connection configures"
        )
    for root, root_scheme, root_path in configured:
        if root_scheme != scheme:
            continue
        prefix = root_path.rstrip("/") + "/"
        if path == root_path or path.startswith(prefix):
            rest = path[len(prefix) :] if path.startswith(prefix) else ""
            return Placed(root, tuple(p for p in rest.split("/") if p))
    raise Refused(
        f"{location} is outside {named}: runs are read only below them. Write the run's output under the "
        "connection's stage_root (a table's under its warehouse)"
    )


def check_local(path: str, root: str) -> None:
    """A local path whose real location (symlinks resolved) is not below the root's real location
    is refused: a link planted in a run directory must not lead a reader out of the stage."""
    real, real_root = os.path.realpath(path), os.path.realpath(normalized_location(root))
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise Refused(
            f"{path} resolves to {real}, outside the connection's root {root}: links out of the roots are not followed"
        )


def open_placed(location: object, roots: Roots, open_root: Callable[[str], Stage]) -> Stage:
    """``location`` opened from the root it lies below: ``open_root`` (the connection's own way to
    open a root: its filesystem, its credentials) opens the root, and the location is its path
    below it. The stage keeps ``location``'s spelling, so messages and a manifest's ``run_dir``
    compare as before. :class:`Refused` for any location :func:`place` refuses, and for a local one
    that resolves out of its root."""
    placed = place(location, roots)
    base = open_root(placed.root)
    stage = Stage(str(location), base.fs, posixpath.join(base.path, *placed.parts) if placed.parts else base.path)
    if stage.fs.type_name == "local":
        check_local(stage.path, placed.root)
    return stage
