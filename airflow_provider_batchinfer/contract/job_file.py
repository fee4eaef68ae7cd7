"""The job file (``_job.json``): what the operator resolved for one attempt, the runtime's only input."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_batchinfer.contract._fields import _get, _opt, _strings
from airflow_provider_batchinfer.contract.layout import JOB_FORMAT, JOB_SPEC_FILE, ContractError
from airflow_provider_batchinfer.contract.records import ModelRef, RunOwner
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec
from airflow_provider_batchinfer.contract.sql_input import SqlInput
from airflow_provider_batchinfer.contract.tables import TableInput, TableOutput
from airflow_provider_batchinfer.contract.url_hosts import parse_url_hosts
from airflow_provider_batchinfer.contract.usage import check_prices


@dataclass(frozen=True)
class JobFile:
    """Everything one attempt of a job needs, resolved by the operator (``_job.json``).

    Writing it claims the run directory for this attempt: a zombie attempt whose ``attempt`` no
    longer matches the file must not commit (the fence). It holds no credentials: those reach the
    runtime through its environment.

    ``identity``: a hex digest of the task instance and of what it computes (input fingerprint,
    model sha256, specs, save mode); a later try with the same identity re-attaches to the job
    ``submission_id`` names while it still runs. Both are written before the job is submitted.
    Job files written before it existed read with None (never re-attached to)."""

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
    # the connection's allowed_url_hosts: the only hosts a message's http(s) URL is fetched from
    allowed_url_hosts: tuple[str, ...] = ()
    llm_engine: str | None = None
    ray_address: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    resume: bool = False
    submission_id: str | None = None
    identity: str | None = None
    format: str = JOB_FORMAT
    # the connection's prices per CPU/GPU hour (contract/usage.py): the usage's cost, the budget guard
    prices: Mapping[str, float] = field(default_factory=dict)
    # Iceberg tables: the table this run commits into (run_dir is then this attempt's data
    # directory under the table's location) and the table snapshot it reads
    table_output: TableOutput | None = None
    table_input: TableInput | None = None
    # a query the job reads into its _input/<attempt>/ (the database URL travels as a secret)
    sql_input: SqlInput | None = None
    # what decided this attempt's rows, field by field (``identity.result_identity``): a RESUME keeps
    # the parts only when a retry's is the same; None (older job files): never resumed
    result: Mapping[str, str] | None = None
    # the attempts whose parts a RESUME may keep, oldest first, this one last: the attempts of one
    # unbroken lineage of the same result identity (``rundir.prepare``); empty (older job files, a
    # fresh start): only this attempt's own
    resumable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = [a for a in self.resumable if not _ATTEMPT.match(a)]
        if bad:
            raise ContractError(
                f"{JOB_SPEC_FILE}.resumable holds {bad[0]!r}, which is not an attempt id (letters and digits only); "
                "this provider did not write that claim: run the task with SaveMode.OVERWRITE to start over"
            )

    @property
    def resumable_attempts(self) -> tuple[str, ...]:
        """The attempts whose parts a RESUME of this attempt keeps, oldest first and this attempt
        last: where two of their parts hold the same row, the later attempt's is kept."""
        return (*(a for a in self.resumable if a != self.attempt), self.attempt)

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
            "allowed_url_hosts": list(self.allowed_url_hosts),
            "llm_engine": self.llm_engine,
            "airflow": self.airflow.to_dict(),
            "ray": {"address": self.ray_address},
            "storage_options": dict(self.storage_options),
            "resume": self.resume,
            "submission_id": self.submission_id,
            "identity": self.identity,
            "prices": dict(self.prices),
            **({"table_output": self.table_output.to_dict()} if self.table_output else {}),
            **({"table_input": self.table_input.to_dict()} if self.table_input else {}),
            **({"sql_input": self.sql_input.to_dict()} if self.sql_input else {}),
            **({"result": dict(self.result)} if self.result is not None else {}),
            **({"resumable": list(self.resumable)} if self.resumable else {}),
        }

    def to_json(self) -> str:
        # insertion order, not sorted keys: the model signature's column order is its feature order
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = JOB_SPEC_FILE) -> JobFile:
        err = ContractError
        fmt = _get(data, "format", str, where, err)
        if fmt != JOB_FORMAT:
            raise err(f"{where} is a {fmt!r} job file; this version of the provider reads {JOB_FORMAT!r}")
        from airflow_provider_batchinfer.contract.specs import SpecError

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
            allowed_url_hosts=parse_url_hosts(_opt(data, "allowed_url_hosts", list, where, err, []), where, err),
            llm_engine=_opt(data, "llm_engine", str, where, err),
            ray_address=_opt(ray, "address", str, f"{where}.ray", err),
            storage_options=_opt(data, "storage_options", dict, where, err, {}),
            resume=bool(_opt(data, "resume", bool, where, err, False)),
            submission_id=_opt(data, "submission_id", str, where, err),
            identity=_opt(data, "identity", str, where, err),
            prices=check_prices(_opt(data, "prices", dict, where, err, {}), f"{where}.prices", err),
            table_output=_table(data, "table_output", TableOutput, where),
            table_input=_table(data, "table_input", TableInput, where),
            sql_input=_table(data, "sql_input", SqlInput, where),
            result=_result(data, where),
            resumable=_strings(_opt(data, "resumable", list, where, err, []), f"{where}.resumable", err),
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str = JOB_SPEC_FILE) -> JobFile:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ContractError(f"{where} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, where)


_ATTEMPT = re.compile(r"^[A-Za-z0-9]+$")  # what a part name carries (contract/layout.py)


def _result(data: Mapping[str, Any], where: str) -> dict[str, str] | None:
    """The optional ``result`` record: field name -> digest, every value a string."""
    section = _opt(data, "result", dict, where, ContractError)
    if section is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in section.items()):
        raise ContractError(f"{where}.result must map field names to digest strings")
    return section


def _table(data: Mapping[str, Any], key: str, kind: Any, where: str) -> Any:
    """An optional section (``TableOutput`` / ``TableInput`` / ``SqlInput``); None when absent."""
    section = _opt(data, key, dict, where, ContractError)
    return None if section is None else kind.from_dict(section, f"{where}.{key}")
