"""The typed contract between the Airflow side and the Ray side, in one place.

The operator resolves everything a job needs into one :class:`JobFile` (``_job.json``), the runtime
reads only that file and answers with one :class:`Manifest` (``_SUCCESS``) and one result or error
line on its output. Every producer and reader (operator, runtime, sensor, trigger, lineage, example
DAGs, demo, benchmarks, tests) goes through the classes here, so renaming a key is one edit.

This module imports neither Airflow nor Ray (nor pyarrow): both sides and a GPU image import it.
Readers validate on read (``from_dict``) and say which key is wrong, because a marker is also an
input an attacker or a half-finished job can forge.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_batchinfer.specs import InputSpec, JobSpec

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


# --- small typed readers ---------------------------------------------------------------------------


def _get(
    data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, error: type[ContractError]
) -> Any:
    if not isinstance(data, Mapping):
        raise error(f"{where} must be a JSON object, got {type(data).__name__}")
    if key not in data:
        raise error(f"{where} has no {key!r}")
    value = data[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise error(f"{where}.{key} must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise error(f"{where}.{key} must be {_kind_name(kind)}, got {type(value).__name__} {value!r:.80}")
    return value


def _opt(
    data: Mapping[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    where: str,
    error: type[ContractError],
    default: Any = None,
) -> Any:
    if data.get(key) is None:
        return default
    return _get(data, key, kind, where, error)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {
            "str": "a string",
            "int": "a whole number",
            "float": "a number",
            "bool": "true/false",
            "dict": "an object",
            "list": "a list",
        }.get(k.__name__, k.__name__)
        for k in kinds
    )


def _strings(values: Any, where: str, error: type[ContractError]) -> tuple[str, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise error(f"{where} must be a list of strings, got {values!r:.120}")
    return tuple(values)


# --- shared records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOwner:
    """The Airflow task instance a run directory belongs to (and which try wrote it)."""

    dag_id: str
    task_id: str
    run_id: str
    try_number: int
    map_index: int = -1

    def same_task(self, other: RunOwner) -> bool:
        return (self.dag_id, self.task_id) == (other.dag_id, other.task_id)

    def same_task_instance(self, other: RunOwner) -> bool:
        """Same dag, task, run and map index: another try of the very same task instance."""
        return (self.dag_id, self.task_id, self.run_id, self.map_index) == (
            other.dag_id,
            other.task_id,
            other.run_id,
            other.map_index,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "dag_id": self.dag_id,
            "task_id": self.task_id,
            "run_id": self.run_id,
            "try_number": self.try_number,
            "map_index": self.map_index,
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], where: str = "airflow", error: type[ContractError] = ContractError
    ) -> RunOwner:
        return cls(
            dag_id=_get(data, "dag_id", str, where, error),
            task_id=_get(data, "task_id", str, where, error),
            run_id=_get(data, "run_id", str, where, error),
            try_number=int(_get(data, "try_number", int, where, error)),
            map_index=int(_opt(data, "map_index", int, where, error, -1)),
        )


@dataclass(frozen=True)
class ModelRef:
    """A resolved, hash-pinned model version. ``signature`` travels in the job file (the runtime
    plans columns with it); the manifest records the version without it."""

    name: str
    version: str
    flavor: str
    sha256: str
    uri: str
    signature: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "flavor": self.flavor,
            "sha256": self.sha256,
            "uri": self.uri,
        }
        if self.signature is not None:
            out["signature"] = dict(self.signature)
        return out

    def without_signature(self) -> ModelRef:
        return ModelRef(self.name, self.version, self.flavor, self.sha256, self.uri)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], where: str = "model", error: type[ContractError] = ContractError
    ) -> ModelRef:
        signature = _opt(data, "signature", dict, where, error)
        return cls(
            name=_get(data, "name", str, where, error),
            version=_get(data, "version", str, where, error),
            flavor=_get(data, "flavor", str, where, error),
            sha256=_get(data, "sha256", str, where, error),
            uri=_get(data, "uri", str, where, error),
            signature=signature,
        )

    @property
    def inputs(self) -> dict[str, Any]:
        return dict((self.signature or {}).get("inputs", {}))

    @property
    def outputs(self) -> dict[str, Any]:
        return dict((self.signature or {}).get("outputs", {}))


# --- the job file ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobFile:
    """Everything one attempt of a job needs, resolved by the operator (``_job.json``).

    Writing it claims the run directory for this attempt: a zombie attempt whose ``attempt`` no
    longer matches the file must not commit (the fence). It holds no credentials: those reach the
    runtime through its environment."""

    job_id: str
    attempt: str
    launcher: str
    run_dir: str
    input_locations: tuple[str, ...]
    input_spec: InputSpec
    job_spec: JobSpec
    model: ModelRef
    registry_root: str
    airflow: RunOwner
    file_roots: tuple[str, ...] = ()
    llm_engine: str | None = None
    ray_address: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    resume: bool = False
    submission_id: str | None = None
    format: str = JOB_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "launcher": self.launcher,
            "run_dir": self.run_dir,
            "input": {"locations": list(self.input_locations)},
            "input_spec": self.input_spec.to_dict(),
            "job_spec": self.job_spec.to_dict(),
            "model": self.model.to_dict(),
            "registry_root": self.registry_root,
            "file_roots": list(self.file_roots),
            "llm_engine": self.llm_engine,
            "airflow": self.airflow.to_dict(),
            "ray": {"address": self.ray_address},
            "storage_options": dict(self.storage_options),
            "resume": self.resume,
            "submission_id": self.submission_id,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = JOB_SPEC_FILE) -> JobFile:
        err = ContractError
        fmt = _get(data, "format", str, where, err)
        if fmt != JOB_FORMAT:
            raise err(f"{where} is a {fmt!r} job file; this version of the provider reads {JOB_FORMAT!r}")
        from airflow_provider_batchinfer.specs import SpecError

        try:
            input_spec = InputSpec.from_dict(_get(data, "input_spec", dict, where, err))
            job_spec = JobSpec.from_dict(_get(data, "job_spec", dict, where, err))
        except SpecError as exc:
            raise err(f"{where}: {exc}") from exc
        ray = _opt(data, "ray", dict, where, err, {})
        return cls(
            job_id=_get(data, "job_id", str, where, err),
            attempt=_get(data, "attempt", str, where, err),
            launcher=_get(data, "launcher", str, where, err),
            run_dir=_get(data, "run_dir", str, where, err),
            input_locations=_strings(
                _get(_get(data, "input", dict, where, err), "locations", list, f"{where}.input", err),
                f"{where}.input.locations",
                err,
            ),
            input_spec=input_spec,
            job_spec=job_spec,
            model=ModelRef.from_dict(_get(data, "model", dict, where, err), f"{where}.model"),
            registry_root=_get(data, "registry_root", str, where, err),
            airflow=RunOwner.from_dict(_get(data, "airflow", dict, where, err), f"{where}.airflow"),
            file_roots=_strings(_opt(data, "file_roots", list, where, err, []), f"{where}.file_roots", err),
            llm_engine=_opt(data, "llm_engine", str, where, err),
            ray_address=_opt(ray, "address", str, f"{where}.ray", err),
            storage_options=_opt(data, "storage_options", dict, where, err, {}),
            resume=bool(_opt(data, "resume", bool, where, err, False)),
            submission_id=_opt(data, "submission_id", str, where, err),
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str = JOB_SPEC_FILE) -> JobFile:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ContractError(f"{where} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, where)


# --- the manifest ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileEntry:
    """One committed file: name relative to the run directory, bytes, rows, and the sha256 of its
    bytes computed while it was written (``None`` only in format-1 markers)."""

    name: str
    size: int
    rows: int
    sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "size": self.size, "rows": self.rows}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str, need_checksum: bool = True) -> FileEntry:
        err = ManifestError
        name = _get(data, "name", str, where, err)
        if not name or name.startswith("/") or ".." in name.replace("\\", "/").split("/"):
            raise err(f"{where}.name={name!r} must be a path inside the run directory (no '..', not absolute)")
        size, rows = _get(data, "size", int, where, err), _get(data, "rows", int, where, err)
        if size < 0 or rows < 0:
            raise err(f"{where}: size and rows must be >= 0, got {size} and {rows}")
        sha = _get(data, "sha256", str, where, err) if need_checksum else _opt(data, "sha256", str, where, err)
        if sha is not None and not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise err(f"{where}.sha256 must be 64 lowercase hex digits, got {sha!r:.80}")
        return cls(name=name, size=size, rows=rows, sha256=sha)


@dataclass(frozen=True)
class Counts:
    input_rows: int
    output_rows: int
    error_rows: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"input_rows": self.input_rows, "output_rows": self.output_rows, "error_rows": self.error_rows}


@dataclass(frozen=True)
class ResumeInfo:
    resumed: bool = False
    kept_files: int = 0
    kept_rows: int = 0
    processed_rows: int = 0
    removed_files: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "resumed": self.resumed,
            "kept_files": self.kept_files,
            "kept_rows": self.kept_rows,
            "processed_rows": self.processed_rows,
            "removed_files": list(self.removed_files),
        }


@dataclass(frozen=True)
class JobRecord:
    """Which job and attempt committed the directory, on which launcher, with how many replicas."""

    id: str
    attempt: str
    launcher: str = "local"
    replicas: int = 1
    device: str = "cpu"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "attempt": self.attempt,
            "launcher": self.launcher,
            "replicas": self.replicas,
            "device": self.device,
        }


@dataclass(frozen=True)
class Manifest:
    """The ``_SUCCESS`` marker: written last, lists every committed file with its size, rows and
    checksum; readers trust only listed files. ``from_dict`` checks the schema and that the counts
    reconcile; checking the files themselves is the stage's job (``stage.validate_manifest``)."""

    run_dir: str
    files: tuple[FileEntry, ...]
    counts: Counts
    model: ModelRef
    job: JobRecord
    input_locations: tuple[str, ...]
    input_files: tuple[str, ...]
    error_files: tuple[FileEntry, ...] = ()
    airflow: RunOwner | None = None
    passthrough_columns: tuple[str, ...] = ()
    output_columns: tuple[str, ...] = ()
    on_error: str = "fail"
    max_error_fraction: float = 0.0
    resume: ResumeInfo = field(default_factory=ResumeInfo)
    started_at: str = ""
    finished_at: str = ""
    timings: Mapping[str, float | None] = field(default_factory=dict)
    format: str = MANIFEST_FORMAT

    @property
    def file_names(self) -> list[str]:
        return [f.name for f in self.files]

    @property
    def error_file_names(self) -> list[str]:
        return [f.name for f in self.error_files]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "run_dir": self.run_dir,
            "files": [f.to_dict() for f in self.files],
            "error_files": [f.to_dict() for f in self.error_files],
            "counts": self.counts.to_dict(),
            "error_policy": {"on_error": self.on_error, "max_error_fraction": self.max_error_fraction},
            "resume": self.resume.to_dict(),
            "columns": {"passthrough": list(self.passthrough_columns), "outputs": list(self.output_columns)},
            "model": self.model.without_signature().to_dict(),
            "input": {"locations": list(self.input_locations), "files": list(self.input_files)},
            "job": self.job.to_dict(),
            "airflow": self.airflow.to_dict() if self.airflow else {},
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "timings": dict(self.timings),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, where: str = SUCCESS_MARKER) -> Manifest:
        err = ManifestError
        fmt = _get(data, "format", str, where, err)
        if fmt not in READABLE_MANIFEST_FORMATS:
            raise err(f"{where} is not a batchinfer manifest (format {fmt!r}; readable: {READABLE_MANIFEST_FORMATS})")
        checksums = fmt != "batchinfer.manifest/1"
        files = tuple(
            FileEntry.from_dict(e, f"{where}.files[{i}]", checksums)
            for i, e in enumerate(_get(data, "files", list, where, err))
        )
        errors = tuple(
            FileEntry.from_dict(e, f"{where}.error_files[{i}]", checksums)
            for i, e in enumerate(_opt(data, "error_files", list, where, err, []))
        )
        c = _get(data, "counts", dict, where, err)
        counts = Counts(
            _get(c, "input_rows", int, f"{where}.counts", err),
            _get(c, "output_rows", int, f"{where}.counts", err),
            _opt(c, "error_rows", int, f"{where}.counts", err, 0),
        )
        job = _get(data, "job", dict, where, err)
        inputs = _get(data, "input", dict, where, err)
        columns = _opt(data, "columns", dict, where, err, {})
        policy = _opt(data, "error_policy", dict, where, err, {})
        resume = _opt(data, "resume", dict, where, err, {})
        airflow = _opt(data, "airflow", dict, where, err, {})
        manifest = cls(
            format=fmt,
            run_dir=_get(data, "run_dir", str, where, err),
            files=files,
            error_files=errors,
            counts=counts,
            model=ModelRef.from_dict(_get(data, "model", dict, where, err), f"{where}.model", err),
            job=JobRecord(
                id=_get(job, "id", str, f"{where}.job", err),
                attempt=_get(job, "attempt", str, f"{where}.job", err),
                launcher=_opt(job, "launcher", str, f"{where}.job", err, "local"),
                replicas=_opt(job, "replicas", int, f"{where}.job", err, 1),
                device=_opt(job, "device", str, f"{where}.job", err, "cpu"),
            ),
            input_locations=_strings(
                _get(inputs, "locations", list, f"{where}.input", err), f"{where}.input.locations", err
            ),
            input_files=_strings(_get(inputs, "files", list, f"{where}.input", err), f"{where}.input.files", err),
            airflow=RunOwner.from_dict(airflow, f"{where}.airflow", err) if airflow else None,
            passthrough_columns=_strings(columns.get("passthrough", []), f"{where}.columns.passthrough", err),
            output_columns=_strings(columns.get("outputs", []), f"{where}.columns.outputs", err),
            on_error=_opt(policy, "on_error", str, f"{where}.error_policy", err, "fail"),
            max_error_fraction=float(
                _opt(policy, "max_error_fraction", (int, float), f"{where}.error_policy", err, 0.0)
            ),
            resume=ResumeInfo(
                resumed=bool(resume.get("resumed", False)),
                kept_files=int(resume.get("kept_files", 0)),
                kept_rows=int(resume.get("kept_rows", 0)),
                processed_rows=int(resume.get("processed_rows", 0)),
                removed_files=tuple(resume.get("removed_files", [])),
            ),
            started_at=_opt(data, "started_at", str, where, err, ""),
            finished_at=_opt(data, "finished_at", str, where, err, ""),
            timings=_opt(data, "timings", dict, where, err, {}),
        )
        manifest.check_counts(where)
        return manifest

    @classmethod
    def from_json(cls, text: str | bytes, where: str = SUCCESS_MARKER) -> Manifest:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{where} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, where)

    def check_counts(self, where: str = SUCCESS_MARKER) -> None:
        """The counts reconcile: listed rows match the counts, and input = output + dead-lettered."""
        for key, entries, count in (
            ("files", self.files, self.counts.output_rows),
            ("error_files", self.error_files, self.counts.error_rows),
        ):
            listed = sum(e.rows for e in entries)
            if listed != count:
                which = "output_rows" if key == "files" else "error_rows"
                raise ManifestError(f"{where}: {key} hold {listed} rows but {which} is {count}")
        c = self.counts
        if c.input_rows != c.output_rows + c.error_rows:
            raise ManifestError(
                f"{where}: input_rows {c.input_rows} != output_rows {c.output_rows} + error_rows {c.error_rows}"
            )


# --- the runtime's last line --------------------------------------------------------------------------

RESULT_PREFIX = "BATCHINFER_RESULT "
ERROR_PREFIX = "BATCHINFER_ERROR "


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
