"""What a run cost: the manifest's optional ``usage`` section and the prices a job file carries.

"Held" is the honest definition of what a job used on a shared cluster: a job reserves its replicas
(and a little CPU for its reads and writes) in one placement group, and nobody else can use that
reservation while the job holds it, whether a replica is busy or idle. So ``cpu_seconds`` is the
reserved CPUs x the seconds the reservation was held, ``gpu_seconds`` likewise; the cost is those
seconds at the connection's prices. ``busy_s`` (the summed time replicas spent in the model) is
reported beside it, so a half-idle pool shows up as a low ``busy_s / (replicas x held_s)`` (a
replica that takes concurrent calls, ``runtime/engine/in_driver.py``, counts each call's time, so it can
reach ``threads x held_s``).

No Airflow, no Ray: both sides read and write these through the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from airflow_provider_batchinfer.contract.layout import ContractError, ManifestError

#: the connection extras (and job-file keys) that price a job, in currency units per hour
PRICE_KEYS = ("price_per_cpu_hour", "price_per_gpu_hour")

#: what ``cpu_seconds`` / ``gpu_seconds`` measure (recorded in every usage section)
BASIS = "reserved x held: the CPUs/GPUs the job's reservation held, times the seconds it held them"


def check_prices(data: Mapping[str, Any], where: str, error: type[Exception] = ContractError) -> dict[str, float]:
    """``{price key: number >= 0}`` from a mapping (the connection's extras or a job file); a key
    that is missing or empty is left out. Raises ``error`` naming the key and what to write."""
    out: dict[str, float] = {}
    for key in PRICE_KEYS:
        value = data.get(key)
        if value in (None, ""):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = -1.0
        if isinstance(value, bool) or not number >= 0 or number == float("inf"):
            raise error(f"{where}: {key} must be a price per hour as a number >= 0 (e.g. 0.048), got {value!r:.80}")
        out[key] = number
    return out


def estimate_cost(cpu_seconds: float, gpu_seconds: float, prices: Mapping[str, float]) -> float | None:
    """Currency units for the seconds held at ``prices``; None when the connection sets no price."""
    if not prices:
        return None
    return cpu_seconds / 3600.0 * float(prices.get("price_per_cpu_hour", 0.0)) + gpu_seconds / 3600.0 * float(
        prices.get("price_per_gpu_hour", 0.0)
    )


@dataclass(frozen=True)
class Usage:
    """The ``usage`` section of a manifest: what this attempt held and did, and what it cost.

    ``wall_s``: the job from its start to its commit. ``held_s``: how long the reservation of
    ``reserved_cpus`` / ``reserved_gpus`` was held (the pipeline). ``rows``: rows this attempt
    scored or dead-lettered (a RESUME keeps earlier attempts' rows without paying for them again).
    ``batch_p50_s`` / ``batch_p95_s``: model-call latency per batch, measured in the replicas.
    ``input_tokens`` / ``output_tokens``: text generation only. ``cost`` is None without prices."""

    wall_s: float
    held_s: float
    reserved_cpus: float
    reserved_gpus: float
    cpu_seconds: float
    gpu_seconds: float
    rows: int
    rows_per_s: float | None = None
    batches: int = 0
    batch_p50_s: float | None = None
    batch_p95_s: float | None = None
    busy_s: float = 0.0
    input_tokens: int | None = None
    output_tokens: int | None = None
    price_per_cpu_hour: float | None = None
    price_per_gpu_hour: float | None = None
    cost: float | None = None
    cost_per_million_rows: float | None = None
    max_cost: float | None = None
    max_output_tokens_total: int | None = None
    basis: str = BASIS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Usage:
        if not isinstance(data, Mapping):
            raise ManifestError(f"{where} must be a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                continue  # a newer writer's key: ignored, so old readers keep reading new manifests
            if (
                value is not None
                and name != "basis"
                and (isinstance(value, bool) or not isinstance(value, (int, float)))
            ):
                raise ManifestError(f"{where}.{name} must be a number, got {value!r:.80}")
            values[name] = value
        missing = [
            n
            for n in ("wall_s", "held_s", "reserved_cpus", "reserved_gpus", "cpu_seconds", "gpu_seconds", "rows")
            if n not in values
        ]
        if missing:
            raise ManifestError(f"{where} has no {missing}")
        values["rows"] = int(values["rows"])
        values["batches"] = int(values.get("batches") or 0)
        for name in ("input_tokens", "output_tokens", "max_output_tokens_total"):
            if values.get(name) is not None:
                values[name] = int(values[name])
        if not isinstance(values.get("basis", BASIS), str):
            raise ManifestError(f"{where}.basis must be a string")
        return cls(**values)
