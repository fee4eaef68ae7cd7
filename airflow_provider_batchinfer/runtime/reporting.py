"""Error reporting: the one place that turns any failure into the runtime's last line.

Ray wraps an error raised in a worker in layers (``UserCodeException`` -> ``RayTaskError(...)``
-> the worker's own exception) whose text is retry advice or a traceback; the user needs the
innermost error, or ours when one is in the chain (a ``StageError`` names the bucket and key; a
``ModelBatchError`` names the model's error and the batch's ids). ``main`` prints it as a
``JobFailure`` line (``contract.py``), with whether a retry can help.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys

from airflow_provider_batchinfer.contract import JobFailure, JobResult
from airflow_provider_batchinfer.runtime.errors import EMPTY_MARKERS, JobError, ModelBatchError, exception_chain
from airflow_provider_batchinfer.store.inputs import InputError
from airflow_provider_batchinfer.store.locations import StageError
from airflow_provider_batchinfer.store.redact import scrub, scrubbed_output, secret_values

log = logging.getLogger("batchinfer.runtime")

_RAY_WRAPPERS = ("UserCodeException", "RayTaskError", "RayActorError", "RaySystemError")

# markers that carry no message of their own: Ray Data raises a failed datasink's error "from
# SystemException()", which hides the Ray wrapper's ``cause`` from a plain __cause__ walk

# errors whose message is written for the user (what failed, where, and what to do next); an
# InputError names the file or column that pyarrow's error behind it does not
_OURS = (StageError, ModelBatchError, InputError)
# ... and those of them that only reach the driver as text in a Ray traceback
_OURS_BY_NAME = frozenset({ModelBatchError.__name__})

# Ray Data appends its retry advice to a failed task's exception message ("Failed to write after
# 1/1 attempts (total backoff 0.0s).\nTo change retry attempts, ..."); it is not the error
_RAY_RETRY_NOTE = re.compile(r"\n\s*Failed to [^\n]* after \d+/\d+ attempts \(total backoff")
_ERROR_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (?P<msg>.*)$", re.MULTILINE)


def is_permanent(exc: BaseException) -> bool:
    """Whether any error in the chain says no retry can fix it (an S3 bucket that does not exist,
    access denied): the operator then fails the task without Airflow retries. A store that stopped
    answering mid-job is not permanent here: the operator reached it just before the launch, so it
    is an outage (a crashed or restarting server), and the task's retries are what recovers it."""
    return any(getattr(e, "permanent", False) and not getattr(e, "unreachable", False) for e in exception_chain(exc))


def _root_message(exc: BaseException) -> str:
    """The user-facing message of an error raised inside a Ray task. Ray wraps it in layers
    (UserCodeException -> RayTaskError(ValueError) -> ValueError) whose own text is advice about
    retries or a traceback; the innermost non-wrapper exception is what the user needs to see,
    unless one of ours (a StageError, a ModelBatchError: it names what failed and what to do) is
    in the chain."""
    chain = exception_chain(exc)
    plain = [e for e in chain if not any(w in type(e).__name__ for w in _RAY_WRAPPERS + EMPTY_MARKERS)]
    if plain:
        ours = [e for e in plain if isinstance(e, _OURS)]
        root = ours[0] if ours else plain[-1]
        lines = [line for line in _RAY_RETRY_NOTE.split(str(root))[0].strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else ""
        name = type(root).__name__
        if isinstance(root, ModelBatchError):  # its message starts with the model's own error
            return last
        return last if last.startswith(name) else f"{name}: {last}" if last else name
    # Ray only carries the user's exception as text inside the wrapper's traceback: the first error
    # line is the innermost cause, unless one of ours (raised "from" it) follows
    found = [
        (match.group("name").rsplit(".", 1)[-1], match.group("msg").strip())
        for wrapper in chain
        for match in _ERROR_LINE.finditer(str(wrapper))
        if not match.group("name").startswith("ray.") and not any(w in match.group("name") for w in _RAY_WRAPPERS)
    ]
    if found:
        name, msg = next((f for f in found if f[0] in _OURS_BY_NAME), found[0])
        return msg if name == ModelBatchError.__name__ else f"{name}: {msg}"
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip() if lines else ''}"


def failure(exc: BaseException) -> JobFailure:
    """The runtime's error line for ``exc``: the user-facing message, the type, whether it is permanent."""
    return JobFailure(error=_root_message(exc), type=type(exc).__name__, permanent=is_permanent(exc))


def main(argv: list[str] | None = None) -> int:
    """``python -m airflow_provider_batchinfer.runtime --spec <job file>``: run the job and print one
    ``JobResult`` line, or one ``JobFailure`` line for any failure (exit 2: the job's inputs or
    state are wrong; 1: anything else)."""
    import argparse

    from airflow_provider_batchinfer.runtime.driver import run
    from airflow_provider_batchinfer.store.delivery import apply_delivered_env

    parser = argparse.ArgumentParser(prog="python -m airflow_provider_batchinfer.runtime")
    parser.add_argument("--spec", required=True, help="location of the job spec (_job.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    secrets: list[str] = []
    try:
        apply_delivered_env()  # a cluster job's S3 session and catalog secrets, before anything opens a store
        secrets = secret_values(os.environ)
    except Exception as exc:
        print(_failure_line(exc, secrets), flush=True)
        return _exit_code(exc)
    with scrubbed_output(secrets):  # every line this job prints or logs, its last line included
        try:
            manifest = run(args.spec)
        except Exception as exc:  # the one place that turns any failure into a clear last line
            log.debug("job failed", exc_info=True)
            print(_failure_line(exc, secrets), flush=True)
            return _exit_code(exc)
        print(JobResult(rows=manifest.counts.output_rows, files=len(manifest.files)).to_line(), flush=True)
    return 0


def _failure_line(exc: BaseException, secrets: list[str]) -> str:
    found = failure(exc)
    return dataclasses.replace(found, error=scrub(found.error, secrets)).to_line()


def _exit_code(exc: BaseException) -> int:
    """2: the job's inputs or state are wrong; 1: anything else."""
    return 2 if isinstance(exc, (InputError, JobError, StageError, ValueError)) else 1


if __name__ == "__main__":
    sys.exit(main())
