"""What a committed part's bytes say, read from a file that is already open: the row count in its
Parquet footer and the sha256 of its bytes, for ``markers`` to compare with the part's manifest
entry.

The footer sits at the end of the file, so the usual footer costs one ranged read of the file's
last bytes (a single request on S3) and a long one a second; hashing reads the file once and
takes the footer from the last bytes hashed, so checking both costs no more than hashing. Works on
any pyarrow file (``read``, ``read_at``): opening it, and turning a store's errors into messages
naming it, is the caller's (``stage``). Storage layer: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import hashlib
from typing import Any

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, ManifestError

__all__ = ["compare_sha256", "footer_rows", "hashed_rows", "sha256_of"]

_CHUNK = 8 * 1024 * 1024
#: the end of a part read in one request: its footer, when the footer is no longer than that
_TAIL = 64 * 1024


def sha256_of(f: Any) -> str:
    """The sha256 of an open file's bytes, read in chunks."""
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def footer_rows(location: str, size: int, f: Any) -> int:
    """Rows in the footer of the open Parquet file ``f`` (``size`` bytes, at ``location``), read
    from its last bytes only. A file overwritten with anything but Parquet has no footer and
    raises ManifestError."""
    return _rows_in_tail(location, size, f, f.read_at(min(size, _TAIL), size - min(size, _TAIL)))


def hashed_rows(location: str, size: int, f: Any) -> tuple[str, int]:
    """The sha256 of the open part ``f``'s bytes and the rows in its footer, from one read of the
    part: the footer comes from the last bytes hashed."""
    digest, tail = hashlib.sha256(), b""
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
        tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
    return digest.hexdigest(), _rows_in_tail(location, size, f, tail)


def _rows_in_tail(location: str, size: int, f: Any, tail: bytes) -> int:
    """Rows in the footer at the end of ``tail`` (the file's last bytes); a footer longer than the
    tail is read from ``f``, the open file. One request for the usual footer, two for a long one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    footer = b""
    if size >= 12 and len(tail) >= 8:
        length = int.from_bytes(tail[-8:-4], "little")
        if tail[-4:] == b"PAR1" and 0 < length <= size - 12:
            footer = tail[-length - 8 :] if length + 8 <= len(tail) else f.read_at(length + 8, size - length - 8)
    try:
        if not footer:
            raise ValueError("Parquet magic bytes or footer length not found at the end of the file")
        return int(pq.read_metadata(pa.BufferReader(b"PAR1" + footer)).num_rows)
    except (ValueError, OSError) as exc:
        raise ManifestError(
            f"{location} is not a readable Parquet file ({exc}); it was overwritten or truncated after the "
            f"commit. Do not use this output: re-run the task that wrote it"
        ) from exc


def compare_sha256(location: str, actual: str, expected: str) -> None:
    """ManifestError unless a file's sha256 (``actual``) is the one its manifest entry records."""
    if actual != expected:
        raise ManifestError(
            f"{location} does not match its sha256 in {SUCCESS_MARKER} (file {actual[:16]}…, manifest "
            f"{expected[:16]}…): it changed after the commit. Do not use this output: re-run the task that wrote it"
        )
