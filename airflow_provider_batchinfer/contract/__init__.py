"""The typed contract between the Airflow side and the Ray side, in one place.

The operator resolves everything a job needs into one :class:`JobFile` (``_job.json``), the runtime
reads only that file and answers with one :class:`Manifest` (``_SUCCESS``) and one result or error
line on its output. Every producer and reader (operator, runtime, sensor, trigger, lineage, example
DAGs, demo, benchmarks, tests) goes through the classes here, so renaming a key is one edit.

This module imports neither Airflow nor Ray (nor pyarrow): both sides and a GPU image import it.
Readers validate on read (``from_dict``) and say which key is wrong, because a marker is also an
input an attacker or a half-finished job can forge.
"""

from airflow_provider_batchinfer.contract.job_file import JobFile
from airflow_provider_batchinfer.contract.layout import (
    ERRORS_DIR,
    INPUT_DIR,
    JOB_FORMAT,
    JOB_SPEC_FILE,
    MANIFEST_FORMAT,
    READABLE_MANIFEST_FORMATS,
    SUCCESS_MARKER,
    ContractError,
    ManifestError,
    attempt_of,
    is_part_name,
    new_attempt_id,
    part_name,
)
from airflow_provider_batchinfer.contract.lines import (
    ERROR_PREFIX,
    RESULT_PREFIX,
    JobFailure,
    JobResult,
    last_failure,
    parse_runtime_line,
)
from airflow_provider_batchinfer.contract.manifest import Counts, FileEntry, JobRecord, Manifest, ResumeInfo
from airflow_provider_batchinfer.contract.records import ModelRef, RunOwner

__all__ = [
    "ERRORS_DIR",
    "ERROR_PREFIX",
    "INPUT_DIR",
    "JOB_FORMAT",
    "JOB_SPEC_FILE",
    "MANIFEST_FORMAT",
    "READABLE_MANIFEST_FORMATS",
    "RESULT_PREFIX",
    "SUCCESS_MARKER",
    "ContractError",
    "Counts",
    "FileEntry",
    "JobFailure",
    "JobFile",
    "JobRecord",
    "JobResult",
    "Manifest",
    "ManifestError",
    "ModelRef",
    "ResumeInfo",
    "RunOwner",
    "attempt_of",
    "is_part_name",
    "last_failure",
    "new_attempt_id",
    "parse_runtime_line",
    "part_name",
]
