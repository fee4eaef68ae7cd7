"""The runtime's last output line: a result or an error, parsed the same way by every launcher."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

RESULT_PREFIX = "BATCHINFER_RESULT "
ERROR_PREFIX = "BATCHINFER_ERROR "
#: set by the local launcher in the environment of a runtime it starts on the embedded Ray: the
#: driver then shares the only Ray node's machine and may score a small job itself (runtime/engine/in_driver.py)
EMBEDDED_RAY_ENV = "BATCHINFER_EMBEDDED_RAY"
#: set beside it when the launcher started that Ray for this job and the job is started while Ray
#: starts: a file the launcher creates once Ray is up, which the runtime waits for before ``ray.init``
EMBEDDED_RAY_READY_ENV = "BATCHINFER_EMBEDDED_RAY_READY"


@dataclass(frozen=True)
class JobResult:
    """The runtime's success line: rows and files it committed."""

    rows: int
    files: int

    def to_line(self) -> str:
        return RESULT_PREFIX + json.dumps({"rows": self.rows, "files": self.files})


@dataclass(frozen=True)
class JobFailure:
    """The runtime's error line: the user-facing message, the exception type, and whether a retry
    can help (``permanent``: no retry can, e.g. access denied)."""

    error: str
    type: str = "Exception"
    permanent: bool = False

    def to_line(self) -> str:
        return ERROR_PREFIX + json.dumps({"error": self.error, "type": self.type, "permanent": self.permanent})


def parse_runtime_line(line: str) -> JobResult | JobFailure | None:
    """The result or error a runtime output line carries, or None for any other line."""
    line = line.rstrip("\r\n")
    try:
        if line.startswith(RESULT_PREFIX):
            data = json.loads(line[len(RESULT_PREFIX) :])
            return JobResult(rows=int(data["rows"]), files=int(data["files"]))
        if line.startswith(ERROR_PREFIX):
            data = json.loads(line[len(ERROR_PREFIX) :])
            return JobFailure(
                error=str(data["error"]),
                type=str(data.get("type", "Exception")),
                permanent=bool(data.get("permanent", False)),
            )
    except (ValueError, KeyError, TypeError):
        return JobFailure(error=f"unreadable runtime line: {line[:200]}")
    return None


def last_failure(lines: Sequence[str] | str) -> JobFailure | None:
    """The last error line in a driver log (a Ray Jobs log is fetched whole)."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    for line in reversed(lines):
        parsed = parse_runtime_line(line)
        if isinstance(parsed, JobFailure):
            return parsed
    return None
