"""Where the run page may read: below the run's connection's stage and registry roots, in their schemes.

A run's XCom (its ``output_location``) and the manifest found there are written by the DAG's own
code, so neither may choose what the api-server opens. A location is placed below one of the
connection's roots by string checks alone, before anything is opened; the page then opens it from
that root, with the filesystem the connection builds for its own stage, so nothing in the location
(a scheme the connection does not configure, an ``endpoint_override`` in a query) can send a
request anywhere else or pick up the api-server's ambient credentials. Local paths are checked
again after symlinks are resolved. No Airflow import: this is unit-tested as plain strings.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from airflow_provider_batchinfer.stage import StageError, check_relative_path, is_uri
from airflow_provider_batchinfer.verdicts import normalized_location

__all__ = ["Placed", "Refused", "check_local", "place"]


class Refused(ValueError):
    """A location the page will not read; its message is shown on the page."""


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


def _shown(roots: Sequence[str]) -> str:
    return ", ".join(roots) or "none configured"


def place(location: object, roots: Sequence[str]) -> Placed:
    """The root ``location`` lies below and its segments under it; :class:`Refused` (naming why)
    for a location that is not a plain absolute path or URI, climbs with ``..``, carries a query or
    fragment, uses a scheme none of the roots use, or lies outside every root."""
    if not isinstance(location, str) or not location.strip():
        raise Refused(f"the run recorded no usable output location ({location!r})")
    if any(c in location for c in "\x00?#\\") or any(ord(c) < 32 for c in location):
        raise Refused(
            f"{location!r} holds a query, a fragment, a backslash or a control character, which no run directory "
            "the operator writes has"
        )
    try:
        check_relative_path(location, "the output location")
    except StageError as exc:
        raise Refused(str(exc)) from None
    if location.startswith("file:/") and not location.startswith("file://"):
        location = location[len("file:") :]  # ``file:/path``: how pyiceberg may spell a local table's files
    if not (is_uri(location) or location.startswith("/")):
        raise Refused(f"{location!r} is not an absolute path or URI; a committed run records an absolute one")
    scheme, path = _split(location)
    configured = [(root, *_split(root)) for root in roots if root]
    if not any(root_scheme == scheme for _, root_scheme, _ in configured):
        raise Refused(
            f"{location} is a {scheme}:// location, and the run's connection configures no root there "
            f"({_shown(roots)}): the page reads only with the storage the connection configures"
        )
    for root, root_scheme, root_path in configured:
        if root_scheme != scheme:
            continue
        prefix = root_path.rstrip("/") + "/"
        if path == root_path or path.startswith(prefix):
            rest = path[len(prefix) :] if path.startswith(prefix) else ""
            return Placed(root, tuple(p for p in rest.split("/") if p))
    raise Refused(
        f"{location} is outside the run's connection's stage_root and registry_root ({_shown(roots)}): the page "
        "reads only below them. Write the run's output under the connection's stage_root to see it here"
    )


def check_local(path: str, root: str) -> None:
    """A local path whose real location (symlinks resolved) is not below the root's real location
    is refused: a link planted in a run directory must not lead the page out of the stage."""
    real, real_root = os.path.realpath(path), os.path.realpath(normalized_location(root))
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise Refused(
            f"{path} resolves to {real}, outside the connection's root {root}: the page does not follow links out "
            "of the stage"
        )
