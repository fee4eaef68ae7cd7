"""Open a checked local path without following a symlink anywhere on it.

``dereference.check_location`` resolves a local reference through its symlinks and checks that
the *resolved* path lies under an allowed root. Opening that path by name afterwards would follow
any symlink that appeared since (a directory on the way swapped for a link to ``/``): the file read
would not be the file checked. So :func:`read_local` walks the resolved path from ``/`` one
component at a time, each relative to the last directory's descriptor, with ``O_NOFOLLOW``: a
symlink met on the way fails the read (the resolved path held none), and ``fstat`` on the opened
descriptor refuses anything but a regular file.

A hard link is a second name for the same file, and nothing about the name checked says where the
other one lies: anyone who can write inside an allowed root can link a file they may read but the
job should not (another run's output, a key file on the same filesystem) under it. So a regular
file with more than one link is refused (:class:`HardLinkError`); a copy has one.
"""

from __future__ import annotations

import errno
import os
import stat

# a directory on the way is opened for lookups only (O_PATH needs no read permission), never via a symlink
_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)
# O_NONBLOCK: opening a FIFO must not hang the worker (it is refused after fstat)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)


class NotFollowedError(OSError):
    """The resolved path changed after the check: a symlink (or a non-directory) is on it now."""


class NotRegularError(OSError):
    """The path names something other than a regular file (a FIFO, a device, a socket)."""


class HardLinkError(NotRegularError):
    """The file has more than one name (hard link): another of its names may lie outside the roots."""


def _open_dir(name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(name, dir_fd):
            raise NotFollowedError(exc.errno, f"{name!r} on its path is a symbolic link now") from None
        raise


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def read_local(path: str) -> bytes:
    """Read the checked, resolved absolute ``path``, opening it one component at a time from ``/``
    with ``O_NOFOLLOW``: the resolved path holds no symlink, so any symlink met here appeared after
    the check, and following it could leave the root. ``fstat`` then refuses anything but a regular
    file with one link."""
    names = [n for n in path.split("/") if n]
    if not names:
        raise IsADirectoryError(errno.EISDIR, "is a directory")
    fd = os.open("/", _DIR_FLAGS)
    try:
        for name in names[:-1]:
            next_fd = _open_dir(name, fd)
            os.close(fd)
            fd = next_fd
        try:
            file_fd = os.open(names[-1], _FILE_FLAGS, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotFollowedError(exc.errno, "the file is a symbolic link now") from None
            raise
    finally:
        os.close(fd)
    info = os.fstat(file_fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(file_fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        if stat.S_ISREG(info.st_mode):
            raise HardLinkError(
                errno.EMLINK,
                f"it has {info.st_nlink} hard links, and another of its names may lie outside the allowed "
                "roots, so it is not read; put a copy of the file there (cp, not ln) and reference the copy",
            )
        raise NotRegularError(errno.EINVAL, "not a regular file")
    with os.fdopen(file_fd, "rb") as f:
        return f.read()
