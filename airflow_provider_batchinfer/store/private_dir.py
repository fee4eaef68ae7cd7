"""Private directories: the local boundary that the embedded default's state, leases and spare
sockets and each node's model cache rely on. Shared by the launchers, the spare runtime process and
the registry's cache.

A directory is private when it is a real directory (not a symbolic link), owned by this process's
uid, with no permission bits for group or others, in a parent that no other user can rename it out
of (owned by this uid or root, and sticky when others may write to it, as ``/tmp`` is). Anything
else may hold files another user planted (a ``state.json`` naming a directory to remove, a socket
that receives a job's credentials, a model to load) or be swapped for one, so it is refused, never
repaired: a directory once writable by others cannot be trusted after a ``chmod``. One of ours that
others could only read is tightened on request (``ensure(..., tighten=True)``): nobody else could
have written into it.

Checks open the directory with ``O_NOFOLLOW`` and look at what was opened, so a symbolic link is
refused rather than followed. Imports neither Airflow nor Ray.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["UnsafeDirectory", "check", "check_parent", "ensure"]

_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectory(PermissionError):
    """A directory that is not private to this user; the message says why."""


def _open(path: Path) -> int:
    try:
        return os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if os.path.islink(path):
            raise UnsafeDirectory(f"{path} is a symbolic link (to {os.readlink(path)}), not a directory") from None
        raise UnsafeDirectory(f"{path} cannot be opened as a directory: {exc.strerror or exc}") from None


def _check_opened(path: Path, info: os.stat_result, others_may_read: bool) -> None:
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})")
    mode = oct(stat.S_IMODE(info.st_mode))
    if info.st_mode & 0o022:
        raise UnsafeDirectory(f"{path} is writable by other users (mode {mode})")
    if info.st_mode & 0o077 and not others_may_read:
        raise UnsafeDirectory(f"{path} is readable by other users (mode {mode}); it must be 0700")


def check(path: Path, *, others_may_read: bool = False) -> os.stat_result:
    """Raise :class:`UnsafeDirectory` unless ``path`` is a private directory of this uid (see the
    module's docstring; ``others_may_read``: read and search bits for others are allowed, as below a
    private root); ``FileNotFoundError`` when it does not exist. Returns what was checked."""
    fd = _open(path)
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    _check_opened(path, info, others_may_read)
    return info


def check_parent(parent: Path) -> None:
    """Nobody but this uid (or root) can rename entries out of ``parent``."""
    info = os.stat(parent)  # followed: /tmp may be a link to the real one
    if info.st_uid not in (0, os.getuid()):
        raise UnsafeDirectory(f"{parent} belongs to uid {info.st_uid}")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(f"{parent} is writable by other users and not sticky")


def _tighten(path: Path) -> None:
    """Ours, a directory that others can at most read: made 0700 through the opened descriptor, so a
    link swapped in after the check is never what gets its mode changed."""
    fd = _open(path)
    try:
        info = os.fstat(fd)
        _check_opened(path, info, others_may_read=True)
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def ensure(path: Path, *, tighten: bool = False) -> Path:
    """``path``, created 0700 when missing (missing parents too), checked private in a safe parent;
    :class:`UnsafeDirectory` when an existing one is not. ``tighten``: one of ours that others can
    only read is made 0700 first (caches made before they had to be private)."""
    path = Path(os.path.abspath(path))
    if not path.parent.exists():
        os.makedirs(path.parent, mode=0o700, exist_ok=True)
    try:
        check_parent(path.parent)
    except UnsafeDirectory as exc:
        raise UnsafeDirectory(f"{path} cannot be private: its parent {exc}") from None
    try:
        os.mkdir(path, 0o700)  # the umask can only take bits away
    except FileExistsError:
        pass
    if tighten:
        _tighten(path)
    check(path)
    return path
