"""The manifest's ``reuse`` section (incremental scoring, ``JobSpec(reuse="unchanged")``).

A run that scores incrementally commits, beside each part, a key file: one 128-bit content key per
row of that part, in the same order (``_reuse/<part>.keys.parquet``). The section lists those files
(with their sizes, rows and sha256, like every committed file), the key scheme and the *context*
digest the keys were made under (model sha256, params, input columns and types, output schema), and
says how many rows were copied from which earlier run and how many were scored. A later run reuses
only from a run whose section has the same scheme and context. Imports neither side.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_batchinfer.contract._fields import _get, _opt, _strings
from airflow_provider_batchinfer.contract.layout import ManifestError

REUSE_DIR = "_reuse"
#: the key scheme: BLAKE2b with a 16-byte digest over (context digest, length-prefixed typed values)
KEY_SCHEME = "batchinfer.reuse/1 blake2b-128"
_KEY_FILE = re.compile(rf"^{REUSE_DIR}/(?P<part>part-[A-Za-z0-9-]+\.parquet)\.keys\.parquet$")


def key_file_name(part: str) -> str:
    """The key file committed beside ``part`` (a part name relative to the run directory)."""
    return f"{REUSE_DIR}/{part}.keys.parquet"


@dataclass(frozen=True)
class IndexFile:
    """One key file: ``name`` under ``_reuse/``, bytes, rows (== its part's rows), sha256, the part it
    describes row for row, and how many of that part's rows were copied rather than scored."""

    name: str
    part: str
    size: int
    rows: int
    sha256: str
    reused_rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "part": self.part,
            "size": self.size,
            "rows": self.rows,
            "sha256": self.sha256,
            "reused_rows": self.reused_rows,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> IndexFile:
        err = ManifestError
        name, part = _get(data, "name", str, where, err), _get(data, "part", str, where, err)
        match = _KEY_FILE.match(name)
        if match is None or match.group("part") != part:
            raise err(f"{where}.name={name!r} must be {key_file_name(part)!r} (the key file of part {part!r})")
        sha = _get(data, "sha256", str, where, err)
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise err(f"{where}.sha256 must be 64 lowercase hex digits, got {sha!r:.80}")
        out = cls(
            name=name,
            part=part,
            size=_get(data, "size", int, where, err),
            rows=_get(data, "rows", int, where, err),
            sha256=sha,
            reused_rows=_opt(data, "reused_rows", int, where, err, 0),
        )
        if min(out.size, out.rows, out.reused_rows) < 0 or out.reused_rows > out.rows:
            raise err(f"{where}: size, rows and reused_rows must be >= 0 and reused_rows <= rows")
        return out


@dataclass(frozen=True)
class ReuseInfo:
    """What incremental scoring did in one run, and the key index it leaves for the next.

    ``reused_rows`` were copied from ``source_run`` (a run directory; None when nothing could be
    reused), ``scored_rows`` went to the model (dead-lettered ones included). ``notes`` say why an
    earlier run was not used (incompatible, or its marker/index failed validation)."""

    mode: str
    scheme: str
    context: str
    index: tuple[IndexFile, ...] = ()
    source_run: str | None = None
    reused_rows: int = 0
    scored_rows: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def indexed_rows(self) -> int:
        return sum(f.rows for f in self.index)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "scheme": self.scheme,
            "context": self.context,
            "index": [f.to_dict() for f in self.index],
            "source_run": self.source_run,
            "reused_rows": self.reused_rows,
            "scored_rows": self.scored_rows,
            "notes": list(self.notes),
        }

    def summary(self) -> dict[str, Any]:
        """The counts for XCom and lineage."""
        return {"reused_rows": self.reused_rows, "scored_rows": self.scored_rows, "reused_from": self.source_run}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> ReuseInfo:
        err = ManifestError
        index = tuple(
            IndexFile.from_dict(e, f"{where}.index[{i}]") for i, e in enumerate(_get(data, "index", list, where, err))
        )
        return cls(
            mode=_get(data, "mode", str, where, err),
            scheme=_get(data, "scheme", str, where, err),
            context=_get(data, "context", str, where, err),
            index=index,
            source_run=_opt(data, "source_run", str, where, err),
            reused_rows=_get(data, "reused_rows", int, where, err),
            scored_rows=_get(data, "scored_rows", int, where, err),
            notes=_strings(_opt(data, "notes", list, where, err, []), f"{where}.notes", err),
        )

    def check(self, parts: Mapping[str, int], input_rows: int, where: str) -> None:
        """Every key file describes a committed part (``parts``: name -> rows) with as many rows, and
        the counts add up: reused rows are indexed rows, reused + scored == input rows."""
        for i, entry in enumerate(self.index):
            if parts.get(entry.part) != entry.rows:
                raise ManifestError(
                    f"{where}.index[{i}] describes {entry.part} with {entry.rows} rows, but the manifest lists "
                    f"{'no such part' if entry.part not in parts else f'{parts[entry.part]} rows'}"
                )
        if self.reused_rows != sum(f.reused_rows for f in self.index):
            raise ManifestError(f"{where}.reused_rows {self.reused_rows} != the sum of the index's reused_rows")
        if self.reused_rows + self.scored_rows != input_rows:
            raise ManifestError(
                f"{where}: reused_rows {self.reused_rows} + scored_rows {self.scored_rows} != input_rows {input_rows}"
            )
