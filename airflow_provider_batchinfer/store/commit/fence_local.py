"""The claim protocol on local and POSIX filesystems: token directories and a rename.

A claim grants its attempt the empty directory ``_claims/<attempt>/`` and revokes every other
token first; the commit writes the marker into its token and renames it to ``_SUCCESS``. Creating
a file in a removed directory fails, and the kernel serializes a rename and an unlink of the same
name, so an attempt whose token was revoked never places a marker; nothing is locked, so a
stopped attempt blocks nobody (the reasoning in full: ``fence``'s docstring and
``docs/commit-protocol.md``). Storage layer: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat

from airflow_provider_batchinfer.contract import SUCCESS_MARKER
from airflow_provider_batchinfer.store.commit.fence import CLAIMS_DIR, ClaimLost, ClaimStore, Hold, pause_for_test
from airflow_provider_batchinfer.store.locations import StageError

__all__ = ["LocalClaims"]

_ROUNDS = 100


class LocalClaims(ClaimStore):
    """Token directories and a rename: see the module docstring. Every step works on directory
    file descriptors opened without following a symlink: a link planted as ``_claims`` or as a
    token is removed, never followed, so no file outside the run directory is ever touched."""

    def _tokens(self) -> str:
        return posixpath.join(self.run_dir.path, CLAIMS_DIR)

    def read(self) -> tuple[bytes, str] | None:
        try:
            with open(self.job_file.path, "rb") as f:
                return f.read(), ""
        except FileNotFoundError:
            return None

    def granted(self, attempt: str) -> bool:
        try:
            parent = os.lstat(self._tokens())
            token = os.lstat(posixpath.join(self._tokens(), _token_name(attempt)))
        except FileNotFoundError:
            return False
        return stat.S_ISDIR(parent.st_mode) and stat.S_ISDIR(token.st_mode)

    def held(self, hold: Hold) -> bool:
        return self.granted(hold.attempt)

    def revoke(self) -> None:
        try:
            fd = _open_dir(self._tokens())
        except NotADirectoryError:
            os.unlink(self._tokens())  # a file or a link by that name: removed, never followed
            return
        if fd is None:
            return
        try:
            for name in os.listdir(fd):
                _remove_token(fd, name)
        finally:
            os.close(fd)

    def grant(self, attempt: str) -> None:
        name = _token_name(attempt)
        for _ in range(_ROUNDS):  # an attempt that just committed may remove an empty _claims/
            with contextlib.suppress(FileExistsError):
                os.mkdir(self._tokens())
            try:
                fd = _open_dir(self._tokens())
            except NotADirectoryError:
                os.unlink(self._tokens())
                continue
            if fd is None:
                continue
            try:
                os.mkdir(name, dir_fd=fd)
                return
            except FileExistsError:
                return
            except FileNotFoundError:
                continue
            finally:
                os.close(fd)
        raise StageError(f"could not create the commit token {self._tokens()}/{name}")

    def write_marker(self, hold: Hold, data: bytes) -> None:
        name = _token_name(hold.attempt)
        lost = f"its commit token {self._tokens()}/{name} was revoked"
        pause_for_test("marker:checked")
        token_fd = self._open_token(name)
        if token_fd is None:
            raise ClaimLost(lost)
        try:
            if not _stage_marker(token_fd, data):  # a revoked token refuses the file
                raise ClaimLost(lost)
            pause_for_test("marker:written")
            run_fd = os.open(self.run_dir.path, os.O_RDONLY | _O_DIRECTORY)
            try:
                os.rename(SUCCESS_MARKER, SUCCESS_MARKER, src_dir_fd=token_fd, dst_dir_fd=run_fd)
            except FileNotFoundError as exc:
                raise ClaimLost(lost) from exc
            finally:
                _fsync_and_close(run_fd)
        finally:
            os.close(token_fd)
        # committed: the token has done its job, and a committed directory holds no _claims/
        with contextlib.suppress(OSError):
            os.rmdir(posixpath.join(self._tokens(), name))
            os.rmdir(self._tokens())

    def _open_token(self, name: str) -> int | None:
        try:
            tokens_fd = _open_dir(self._tokens())
            if tokens_fd is None:
                return None
            try:
                return _open_dir(name, tokens_fd)
            finally:
                os.close(tokens_fd)
        except NotADirectoryError:
            return None


_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _token_name(attempt: str) -> str:
    """The attempt as one path segment (attempt ids are; a job file could say otherwise)."""
    if not attempt or "/" in attempt or "\0" in attempt or attempt in (".", ".."):
        raise StageError(f"attempt {attempt!r} cannot name a commit token")
    return attempt


def _open_dir(name: str, dir_fd: int | None = None) -> int | None:
    """A descriptor of directory ``name`` opened without following a symlink; None when there is
    none; NotADirectoryError for a file or a symlink by that name."""
    try:
        return os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise NotADirectoryError(exc.errno, f"{name} is not a directory") from exc
        raise


def _stage_marker(token_fd: int, data: bytes) -> bool:
    """Write ``data`` as ``_SUCCESS`` inside the token, durably. False when the token is revoked
    (a removed directory refuses new files). A file left by an earlier commit of the same attempt,
    or a link planted there, is removed first (O_EXCL and O_NOFOLLOW: nothing is followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW
    for _ in range(_ROUNDS):
        try:
            fd = os.open(SUCCESS_MARKER, flags, 0o666, dir_fd=token_fd)
            break
        except FileNotFoundError:
            return False
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SUCCESS_MARKER, dir_fd=token_fd)
    else:
        return False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _remove_token(parent_fd: int, name: str) -> None:
    """Revoke one token: remove what its attempt staged in it, then the directory. A file staged
    in between makes ``rmdir`` fail; remove again. Bounded: an attempt stages one file at a time."""
    for _ in range(_ROUNDS):
        try:
            fd = _open_dir(name, parent_fd)
        except NotADirectoryError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent_fd)  # not a token: removed all the same, never followed
            return
        if fd is None:
            return
        try:
            for child in os.listdir(fd):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child, dir_fd=fd)
        finally:
            os.close(fd)
        try:
            os.rmdir(name, dir_fd=parent_fd)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):  # anything but "a file was staged meanwhile"
                raise
    raise StageError(f"could not revoke the commit token {name}: its attempt keeps writing into it")


def _fsync_and_close(fd: int) -> None:
    """Make a rename durable (best-effort: not every filesystem syncs a directory), then close."""
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
