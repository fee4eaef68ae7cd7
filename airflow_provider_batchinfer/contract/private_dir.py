"""Private directories: the local boundary the embedded default's state, leases and spare sockets
rely on. Shared by the ``local`` launcher's side and the spare runtime process.

A directory is private when it is a real directory (not a symbolic link), owned by this process's
uid, with no permission bits for group or others, in a parent that no other user can rename it out
of (owned by this uid or root, and sticky when others may write to it, as ``/tmp`` is). Anything
else may hold files another user planted (a ``state.json`` naming a directory to remove, a socket
that receives a job's credentials) or be swapped for one, so it is refused, never repaired: a
directory once writable by others cannot be trusted after a ``chmod``.

Checks open the directory with ``O_NOFOLLOW`` and look at what was opened, so a symbolic link is
refused rather than followed. Imports neither Airflow nor Ray.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["UnsafeDirectory", "check", "ensure"]

_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectory(PermissionError):
    """A directory that is not private to this user; the message says why."""


def check(path: Path) -> None:
    """Raise :class:`UnsafeDirectory` unless ``path`` is a private directory of this uid (see the
    module's docstring); ``FileNotFoundError`` when it does not exist."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if os.path.islink(path):
            raise UnsafeDirectory(f"{path} is a symbolic link (to {os.readlink(path)}), not a directory") from None
        raise UnsafeDirectory(f"{path} cannot be opened as a directory: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {info.st_uid}, not to this process's uid {os.getuid()}")
    if info.st_mode & 0o077:
        raise UnsafeDirectory(
            f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: other users may read or write it (it must be 0700)"
        )


def _check_parent(parent: Path) -> None:
    """Nobody but this uid (or root) can rename entries out of ``parent``."""
    info = os.stat(parent)  # followed: /tmp may be a link to the real one
    if info.st_uid not in (0, os.getuid()):
        raise UnsafeDirectory(f"its parent {parent} belongs to uid {info.st_uid}")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(f"its parent {parent} may be written by other users and is not sticky")


def ensure(path: Path) -> Path:
    """``path``, created 0700 when missing (missing parents too), checked private in a safe parent;
    :class:`UnsafeDirectory` when an existing one is not."""
    path = Path(os.path.abspath(path))
    if not path.parent.exists():
        os.makedirs(path.parent, mode=0o700, exist_ok=True)
    try:
        _check_parent(path.parent)
    except UnsafeDirectory as exc:
        raise UnsafeDirectory(f"{path} cannot be private: {exc}") from None
    try:
        os.mkdir(path, 0o700)  # the umask can only take bits away
    except FileExistsError:
        pass
    check(path)
    return path
