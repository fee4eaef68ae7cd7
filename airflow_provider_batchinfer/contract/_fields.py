"""Typed readers for JSON objects: each failure names the key and what it should hold."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_batchinfer.contract.layout import ContractError


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
