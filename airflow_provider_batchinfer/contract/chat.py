"""OpenAI Chat Completions shapes for batch jobs: ``messages`` in, ``choices`` and ``usage`` out.

Both sides use this module: ``data_prep`` tasks build a ``messages`` column with
:func:`text_to_messages`, and every text-generation engine (transformers on CPU, vLLM on GPU)
turns its output into the same Arrow columns with :func:`response_columns`, so a DAG does not
change when its engine does. It imports neither Airflow nor Ray (pyarrow only inside functions).
"""

from __future__ import annotations

import json
import string
from typing import Any

# the sampling parameters a job (InputSpec.params) or a row (its ``sampling_params`` column) may set
SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 256, "stop": None, "seed": None}
FINISH_REASONS = ("stop", "length")


def text_to_messages(
    table: Any, template: str = "{text}", *, system: str | None = None, column: str = "messages"
) -> Any:
    """Return ``table`` with a ``messages`` column built from a prompt template.

    ``template`` is a ``str.format`` template over the table's columns, e.g.
    ``"Summarize support ticket {ticket_id} in one sentence:\\n{text}"``; ``system`` adds a system
    message first. The column is an Arrow ``list<struct<role, content>>``, which Parquet stores as
    is and every engine reads.
    """
    import pyarrow as pa

    fields = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    missing = sorted({f for f in fields if f not in table.column_names})
    if missing:
        raise ValueError(f"prompt template names {missing}, which are not columns of the table ({table.column_names})")
    values = {f: table.column(f).to_pylist() for f in set(fields)}
    rows = []
    for i in range(table.num_rows):
        prompt = template.format(**{f: values[f][i] for f in values})
        messages = [{"role": "system", "content": system}] if system else []
        rows.append([*messages, {"role": "user", "content": prompt}])
    message_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    array = pa.array(rows, message_type)
    if column in table.column_names:
        return table.set_column(table.column_names.index(column), column, array)
    return table.append_column(column, array)


def sampling_params(job_params: dict[str, Any], row_override: Any = None) -> dict[str, Any]:
    """Job-wide ``InputSpec.params`` with a row's overrides on top (a dict or a JSON string), checked.

    Unknown keys fail, so a typo such as ``max_token`` never silently falls back to a default."""
    override = row_override
    if isinstance(override, str):
        override = json.loads(override) if override.strip() else {}
    merged = dict(SAMPLING_DEFAULTS)
    for source, values in (("InputSpec.params", job_params or {}), ("sampling_params column", override or {})):
        if not isinstance(values, dict):
            raise ValueError(f"{source} must be a dict of sampling parameters, got {values!r}")
        values = {("max_tokens" if k == "max_completion_tokens" else k): v for k, v in values.items() if v is not None}
        unknown = sorted(set(values) - set(SAMPLING_DEFAULTS))
        if unknown:
            raise ValueError(
                f"{source} has unknown sampling parameter(s) {unknown}; known: {sorted(SAMPLING_DEFAULTS)}"
            )
        merged.update(values)
    stop = merged["stop"]
    merged["stop"] = [stop] if isinstance(stop, str) else list(stop) if stop else None
    if not isinstance(merged["max_tokens"], int) or merged["max_tokens"] < 1:
        raise ValueError(f"max_tokens must be a whole number >= 1, got {merged['max_tokens']!r}")
    if not 0 <= float(merged["temperature"]) <= 2:
        raise ValueError(f"temperature must be in [0, 2], got {merged['temperature']!r}")
    if not 0 < float(merged["top_p"]) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {merged['top_p']!r}")
    return merged


def response(content: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """One row's ``choices`` and ``usage``, shaped as in an OpenAI Chat Completions response."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": int(prompt_tokens),
            "completion_tokens": int(completion_tokens),
            "total_tokens": int(prompt_tokens) + int(completion_tokens),
        },
    }


def response_types() -> tuple[Any, Any]:
    """Arrow types of the ``choices`` and ``usage`` output columns."""
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    choice = pa.struct([("index", pa.int32()), ("message", message), ("finish_reason", pa.string())])
    usage = pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("total_tokens", pa.int64())])
    return pa.list_(choice), usage


def response_columns(responses: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"choices": Array, "usage": Array}`` for a batch of :func:`response` dicts."""
    import pyarrow as pa

    choices_type, usage_type = response_types()
    return {
        "choices": pa.array([r["choices"] for r in responses], choices_type),
        "usage": pa.array([r["usage"] for r in responses], usage_type),
    }


def finish_reason(completion_tokens: int, max_tokens: int, stopped: bool) -> str:
    """``stop`` when the model ended (EOS or a stop string), ``length`` when it hit ``max_tokens``."""
    return "stop" if stopped or completion_tokens < max_tokens else "length"
