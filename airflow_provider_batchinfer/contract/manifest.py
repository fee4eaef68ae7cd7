"""The ``_SUCCESS`` manifest: what a run committed, the one schema every reader validates with."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_batchinfer.contract._fields import _get, _opt, _strings
from airflow_provider_batchinfer.contract.layout import (
    MANIFEST_FORMAT,
    READABLE_MANIFEST_FORMATS,
    SUCCESS_MARKER,
    ManifestError,
)
from airflow_provider_batchinfer.contract.records import ModelRef, RunOwner
from airflow_provider_batchinfer.contract.reuse import ReuseInfo
from airflow_provider_batchinfer.contract.tables import TableInput, TableOutput
from airflow_provider_batchinfer.contract.usage import Usage


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
class NodeReplicas:
    """How many of the job's replicas ran on one Ray node."""

    node_id: str
    node_ip: str
    replicas: int

    def to_dict(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "node_ip": self.node_ip, "replicas": self.replicas}


@dataclass(frozen=True)
class PoolRecord:
    """The actor pool a job ran: between ``min_replicas`` and ``max_replicas`` (what it reserved) over
    ``num_workers`` nodes, the CPUs/GPUs it reserved, how long it waited for them, and where the
    replicas ran (``nodes``)."""

    min_replicas: int
    max_replicas: int
    num_workers: int = 1
    reserved_cpus: float = 0.0
    reserved_gpus: float = 0.0
    waited_s: float = 0.0
    nodes: tuple[NodeReplicas, ...] = ()
    # a small job scored in the driver process, without an actor pool (runtime/engine/in_driver.py)
    in_driver: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "num_workers": self.num_workers,
            "reserved": {"cpus": self.reserved_cpus, "gpus": self.reserved_gpus},
            "waited_s": self.waited_s,
            "nodes": [n.to_dict() for n in self.nodes],
            "in_driver": self.in_driver,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> PoolRecord:
        err = ManifestError
        reserved = _opt(data, "reserved", dict, where, err, {})
        nodes = _opt(data, "nodes", list, where, err, [])
        return cls(
            min_replicas=_get(data, "min_replicas", int, where, err),
            max_replicas=_get(data, "max_replicas", int, where, err),
            num_workers=_opt(data, "num_workers", int, where, err, 1),
            reserved_cpus=float(_opt(reserved, "cpus", (int, float), f"{where}.reserved", err, 0.0)),
            reserved_gpus=float(_opt(reserved, "gpus", (int, float), f"{where}.reserved", err, 0.0)),
            waited_s=float(_opt(data, "waited_s", (int, float), where, err, 0.0)),
            nodes=tuple(
                NodeReplicas(
                    node_id=_get(n, "node_id", str, f"{where}.nodes[{i}]", err),
                    node_ip=_opt(n, "node_ip", str, f"{where}.nodes[{i}]", err, ""),
                    replicas=_get(n, "replicas", int, f"{where}.nodes[{i}]", err),
                )
                for i, n in enumerate(nodes)
            ),
            in_driver=_opt(data, "in_driver", bool, where, err, False),
        )


@dataclass(frozen=True)
class JobRecord:
    """Which job and attempt committed the directory, on which launcher, with how many replicas
    (and, from runtimes that record it, the pool and where its replicas ran: ``pool``)."""

    id: str
    attempt: str
    launcher: str = "local"
    replicas: int = 1
    device: str = "cpu"
    pool: PoolRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "attempt": self.attempt,
            "launcher": self.launcher,
            "replicas": self.replicas,
            "device": self.device,
        }
        if self.pool is not None:
            out["pool"] = self.pool.to_dict()
        return out


@dataclass(frozen=True)
class Manifest:
    """The ``_SUCCESS`` marker: written last, lists every committed file with its size, rows and
    checksum; readers trust only listed files. ``from_dict`` checks the schema and that the counts
    reconcile; checking the files themselves is the store's (``store/commit/markers.py``: ``validate_manifest``)."""

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
    # seconds and rows/s: total_s, ray_init_s, pipeline_s, rows_per_s, steady_rows_per_s,
    # id_check_s (the InputSpec.id_column uniqueness check; null without an id column, absent in
    # manifests written before it), resume_s (SaveMode.RESUME finding the rows left to score;
    # null when not resuming, absent in manifests written before it) and reuse_s (incremental
    # scoring matching the input's keys against an earlier run's; null without an earlier run,
    # absent in manifests written before it)
    timings: Mapping[str, float | None] = field(default_factory=dict)
    format: str = MANIFEST_FORMAT
    # what the attempt held and cost (contract/usage.py); None in manifests written before it
    usage: Usage | None = None
    # Iceberg tables: the table the run committed into (snapshot_id: the snapshot that did,
    # filled in when read back from the table) and the table snapshot it read
    table: TableOutput | None = None
    table_input: TableInput | None = None
    # incremental scoring: rows reused / scored and the key index (None: reuse was off)
    reuse: ReuseInfo | None = None
    # "module:Class" a python model imported from the workers' installed packages, not from code
    # logged with the version (its digest does not cover it); absent in manifests without one
    unhashed_imports: tuple[str, ...] = ()

    @property
    def file_names(self) -> list[str]:
        return [f.name for f in self.files]

    @property
    def error_file_names(self) -> list[str]:
        return [f.name for f in self.error_files]

    @property
    def id_check_s(self) -> float | None:
        """Seconds the input's id column took to check unique (``timings.id_check_s``); None without
        an id column, or in a manifest written before the check was timed."""
        seconds = self.timings.get("id_check_s")
        return None if seconds is None else float(seconds)

    @property
    def resume_s(self) -> float | None:
        """Seconds a resumed attempt took to find the rows left to score (``timings.resume_s``);
        None when not resuming, or in a manifest written before it was timed."""
        seconds = self.timings.get("resume_s")
        return None if seconds is None else float(seconds)

    @property
    def reuse_s(self) -> float | None:
        """Seconds incremental scoring took to match the input's keys against an earlier run's
        (``timings.reuse_s``); None without an earlier run, or in a manifest written before it."""
        seconds = self.timings.get("reuse_s")
        return None if seconds is None else float(seconds)

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
            **({"usage": self.usage.to_dict()} if self.usage is not None else {}),
            **({"table": self.table.to_dict()} if self.table else {}),
            **({"table_input": self.table_input.to_dict()} if self.table_input else {}),
            **({"reuse": self.reuse.to_dict()} if self.reuse is not None else {}),
            **({"unhashed_imports": list(self.unhashed_imports)} if self.unhashed_imports else {}),
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
                pool=PoolRecord.from_dict(job["pool"], f"{where}.job.pool") if job.get("pool") else None,
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
            usage=Usage.from_dict(data["usage"], f"{where}.usage") if data.get("usage") else None,
            table=_table_section(data, "table", TableOutput, where),
            table_input=_table_section(data, "table_input", TableInput, where),
            reuse=ReuseInfo.from_dict(data["reuse"], f"{where}.reuse") if data.get("reuse") else None,
            unhashed_imports=_strings(data.get("unhashed_imports", []), f"{where}.unhashed_imports", err),
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
        if self.reuse is not None:  # the key files describe listed parts, reused + scored == input
            self.reuse.check({f.name: f.rows for f in self.files}, c.input_rows, f"{where}.reuse")


def _table_section(data: Mapping[str, Any], key: str, kind: Any, where: str) -> Any:
    """An optional table section; a malformed one is a ManifestError naming the key."""
    from airflow_provider_batchinfer.contract.layout import ContractError

    section = _opt(data, key, dict, where, ManifestError)
    if section is None:
        return None
    try:
        return kind.from_dict(section, f"{where}.{key}")
    except ContractError as exc:
        raise ManifestError(str(exc)) from exc
