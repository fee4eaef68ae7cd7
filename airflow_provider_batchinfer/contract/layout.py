"""The run directory's names and the contract's errors: what both sides call each file."""

from __future__ import annotations

import re
import uuid

# --- run-directory layout ------------------------------------------------------------------------
SUCCESS_MARKER = "_SUCCESS"
JOB_SPEC_FILE = "_job.json"
INPUT_DIR = "_input"
ERRORS_DIR = "_errors"

JOB_FORMAT = "batchinfer.job/1"
MANIFEST_FORMAT = "batchinfer.manifest/2"
#: formats a reader accepts; format 1 markers (no checksums) were written by 0.1.0 and still read
READABLE_MANIFEST_FORMATS = ("batchinfer.manifest/1", MANIFEST_FORMAT)

_PART_NAME = re.compile(rf"^(?:{ERRORS_DIR}/)?part-(?P<block>\d+)-(?P<attempt>[A-Za-z0-9]+)\.parquet$")


def part_name(task_index: int, attempt: str, *, dead_letter: bool = False) -> str:
    """The name of one output part, relative to the run directory: deterministic per write task and
    attempt, so a retried Ray write task overwrites its own part instead of leaving a duplicate."""
    name = f"part-{int(task_index):05d}-{attempt}.parquet"
    return f"{ERRORS_DIR}/{name}" if dead_letter else name


def is_part_name(name: str) -> bool:
    """Whether ``name`` (relative to the run directory) is an output or dead-letter part."""
    return bool(_PART_NAME.match(name))


def attempt_of(name: str) -> str | None:
    """The attempt id a part name carries, or None for a name that is not a part."""
    match = _PART_NAME.match(name)
    return match.group("attempt") if match else None


def new_attempt_id(try_number: int | None) -> str:
    """An id for one attempt: readable (the try number) and unique (a zombie of the same try differs)."""
    prefix = f"t{int(try_number):02d}" if try_number is not None else "t00"
    return f"{prefix}{uuid.uuid4().hex[:8]}"


class ContractError(ValueError):
    """A job file or manifest that does not follow the contract; the message names the key."""


class ManifestError(ContractError):
    """A ``_SUCCESS`` manifest that is malformed or does not describe the files beside it."""
