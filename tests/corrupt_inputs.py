"""Parquet files damaged the ways a copy or a crashed writer leaves them, for the tests that prove a
corrupt input fails the job permanently, naming the file (tests/unit/test_parquet_read.py,
tests/e2e/test_corrupt_input.py)."""

from __future__ import annotations

from pathlib import Path

#: how a file can be damaged: cut short (no footer), its closing magic bytes overwritten, smaller
#: than a footer, its footer overwritten (the length and magic kept), or its pages overwritten
#: behind an intact footer (the footer checks pass; only a read of the rows finds it)
DAMAGE = ("truncated", "bad_magic", "tiny", "bad_footer", "bad_pages")


def damage(path: Path, how: str) -> Path:
    """Damage the Parquet file at ``path`` in place, as ``how`` (one of :data:`DAMAGE`) says."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "bad_magic":
        data[-4:] = b"PAR0"
    elif how == "tiny":
        data = data[:4]
    elif how == "bad_footer":
        data[-8 - footer : -8] = b"\xff" * footer
    elif how == "bad_pages":
        data[4 : len(data) - 8 - footer] = b"\x55" * (len(data) - 12 - footer)
    else:
        raise ValueError(f"unknown damage {how!r}; use one of {DAMAGE}")
    path.write_bytes(bytes(data))
    return path
