"""Bad rows: finding them, naming them, and dead-lettering them instead of failing a whole job.

A nightly job over 200 million rows must not be ruined by one corrupt record, but it must not
silently drop rows either. The default policy (``JobSpec.on_error="fail"``) costs nothing extra: a
batch is scored once, and the first bad row fails the job with a message naming the column and the
row's id. With ``"dead_letter"`` a batch that raises is re-scored by halves until the failing rows
are isolated (about ``2 x log2(batch)`` extra model calls per bad row, and none at all while no
batch fails); the failing rows come back with an error message in :data:`ERROR_COLUMN`, and the
datasink writes them to ``_errors/`` instead of the predictions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from airflow_provider_batchinfer.store.redact import clip

ERROR_COLUMN = "__batchinfer_error"
MAX_MESSAGE_CHARS = 2000


class JobError(RuntimeError):
    """The job cannot finish; nothing is committed. The message says why."""


class BadRowError(ValueError):
    """Rows of a batch cannot be scored; the message names the column and the first row's id."""


class ModelBatchError(RuntimeError):
    """The model raised on a batch under ``on_error="fail"``: names the model's error, the batch's id
    or row range, and how to isolate the failing rows instead (``on_error="dead_letter"``).

    Its message starts with the model's own error (``ValueError: ...``), which is what a user greps
    the log for; the reporting shows it without this class's name."""


def batch_range(batch: Any, id_column: str | None) -> str:
    """Where a batch lies: ``"<id_column> 100..149"`` (min..max of its ids) with an id column, else
    its size and row range (Ray Data does not tell a batch where its rows sat in the input)."""
    rows = batch.num_rows
    if id_column and id_column in batch.column_names:
        import pyarrow.compute as pc

        bounds = pc.min_max(batch.column(id_column))
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        return f"the batch of {rows:,} row(s) with {id_column} {low!r}..{high!r}"
    return (
        f"a batch of {rows:,} row(s) (rows 0..{max(rows - 1, 0)} of the batch; set InputSpec(id_column=...) "
        "to have errors name the rows' ids)"
    )


def model_batch_error(model: str, exc: BaseException, batch: Any, id_column: str | None) -> ModelBatchError:
    """The error for a model that raised on ``batch``: one line, what the model said first."""
    return ModelBatchError(
        f"{error_message(exc)}, raised by model {model} on {batch_range(batch, id_column)}; nothing was committed. "
        'Fix the rows or the model, or set JobSpec(on_error="dead_letter") to isolate the failing rows into '
        "_errors/ and commit the rest"
    )


def _first(mask: Any, ids: Any) -> str:
    """' (first at <id column>=<value>)' for the first True in ``mask``, or the batch row."""
    import pyarrow.compute as pc

    index = pc.index(mask, True).as_py()
    if ids is None:
        return f" (first at row {index} of the batch)"
    name, column = ids
    return f" (first at {name}={column[index].as_py()!r})"


def check_batch(
    inputs: Any,
    sources: list[str],
    ids: tuple[str, Any] | None,
    max_value_bytes: int | None,
    missing_ok: Collection[str] = (),
) -> None:
    """Refuse a batch whose model inputs hold a null, a NaN, text that is not valid UTF-8 or a value
    above ``max_value_bytes``: the model would raise something cryptic, or worse, score garbage.

    ``inputs`` holds the model's input columns (named as the model knows them), ``sources`` the input
    columns they came from (for the message), ``ids`` ``(name, column)`` of the id column or None; ``missing_ok``: model inputs whose nulls and NaN
    are missing values the model handles (the tree flavors)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = inputs.num_rows
    for name, src in zip(inputs.column_names, sources, strict=False):
        col = inputs.column(name)
        if col.null_count and name not in missing_ok:
            raise BadRowError(
                f"column {src!r} has {col.null_count} null value(s) in a batch of {rows} rows"
                f"{_first(col.is_null(), ids)}; fill or filter them in data_prep"
            )
        kind = col.type
        # the sum is NaN whenever a value is (or +inf meets -inf): one SIMD pass instead of a mask per column
        if pa.types.is_floating(kind) and name not in missing_ok and _maybe_nan(pc.sum(col).as_py()):
            nan = pc.is_nan(col)
            if pc.any(nan).as_py():
                raise BadRowError(
                    f"column {src!r} has {pc.sum(nan).as_py()} NaN value(s) in a batch of {rows} rows"
                    f"{_first(nan, ids)}; fill or filter them in data_prep"
                )
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            try:
                col.validate(full=True)
            except pa.ArrowInvalid:
                raw = col.cast(pa.large_binary() if pa.types.is_large_string(kind) else pa.binary())
                bad = [_not_utf8(v) for v in raw.to_pylist()]
                raise BadRowError(
                    f"column {src!r} holds text that is not valid UTF-8 in {sum(bad)} row(s)"
                    f"{_first(pa.array(bad), ids)}; decode it in data_prep (e.g. errors='replace')"
                ) from None
        if max_value_bytes and (
            pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)
        ):
            sizes = pc.binary_length(col)
            too_big = pc.greater(sizes, max_value_bytes)
            if pc.any(too_big).as_py():
                raise BadRowError(
                    f"column {src!r} has a value of {pc.max(sizes).as_py():,} bytes, above "
                    f"JobSpec.max_value_bytes={max_value_bytes:,}{_first(too_big, ids)}; split or "
                    "truncate it in data_prep, or raise max_value_bytes"
                )


def _maybe_nan(total: float | None) -> bool:
    return total is not None and total != total


def _not_utf8(value: bytes | None) -> bool:
    if value is None:
        return False
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def error_message(exc: BaseException) -> str:
    """One line per failing row: the exception's type and its last meaningful line."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[-1].strip() if lines else ''}"
    return clip(text, MAX_MESSAGE_CHARS)  # scrubbed before the cut: a dead-lettered row holds no secret


def score_isolating(score: Callable[[Any], Any], batch: Any, keep_columns: list[str]) -> Any:
    """``score(batch)``, except that rows which make it raise come back as rows holding only
    ``keep_columns`` (ids, passthrough) and :data:`ERROR_COLUMN`, found by bisecting the batch.

    The common case (nothing raises) is one call. Results of the halves are concatenated with
    schema promotion: good rows have null errors, failed rows have null outputs."""
    import pyarrow as pa

    try:
        return score(batch)
    except Exception as exc:  # any user-model error is a row-level error here, by policy
        if batch.num_rows <= 1:
            keep = {c: batch.column(c) for c in keep_columns if c in batch.column_names}
            keep[ERROR_COLUMN] = pa.array([error_message(exc)] * batch.num_rows, pa.string())
            return pa.table(keep)
        mid = batch.num_rows // 2
        halves = [
            score_isolating(score, batch.slice(0, mid), keep_columns),
            score_isolating(score, batch.slice(mid), keep_columns),
        ]
        return pa.concat_tables(halves, promote_options="default")


def split_errors(table: Any, keep_columns: list[str]) -> tuple[Any, Any]:
    """(scored rows, dead-lettered rows) of one block; either may be None. The dead-lettered rows
    keep ``keep_columns`` (ids, passthrough) and the message as column ``error``."""
    import pyarrow.compute as pc

    if ERROR_COLUMN not in table.column_names:
        return (table if table.num_rows else None), None
    failed = pc.is_valid(table.column(ERROR_COLUMN))
    good = table.filter(pc.invert(failed)).drop_columns([ERROR_COLUMN])
    keep = [c for c in keep_columns if c in table.column_names]
    bad = table.filter(failed).select([*keep, ERROR_COLUMN]).rename_columns([*keep, "error"])
    return (good if good.num_rows else None), (bad if bad.num_rows else None)


#: exception types Ray raises as a message-less marker in front of the real cause
EMPTY_MARKERS = ("SystemException",)


def exception_chain(exc: BaseException) -> list[BaseException]:
    """The exception and what lies behind it, one step at a time: ``__cause__``, else what a Ray
    wrapper carries as ``cause`` (the worker's own exception), else ``__context__``. A message-less
    marker as ``__cause__`` is stepped over, so the wrapper's ``cause`` is still reached."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not c for c in chain):
        chain.append(current)
        explicit = current.__cause__
        if explicit is not None and type(explicit).__name__ in EMPTY_MARKERS:
            explicit = None
        cause = getattr(current, "cause", None)
        current = explicit or (cause if isinstance(cause, BaseException) else None) or current.__context__
    return chain
