"""Records both files share: who owns a run directory and which model version it used."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_batchinfer.contract._fields import _get, _opt
from airflow_provider_batchinfer.contract.layout import ContractError


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
