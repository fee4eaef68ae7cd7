"""Content keys for incremental scoring, and where the lookup of an earlier run's keys happens.

**The key.** Each row's key is BLAKE2b with a 16-byte (128-bit) digest, keyed with the run's
*context* digest (sha256 over the key scheme, model name/version, sha256 and flavor, params, engine, the model's
input columns with their Arrow types, and the output schema), over the row's model-input values in
signature order, each text or nested value as a type tag, an 8-byte length and its bytes (UTF-8,
or canonical JSON), then the numbers as one fixed-width row of validity bytes and little-endian
values (a null is its own tag or validity byte). Equal
keys therefore mean equal inputs under an equal model, params and output schema, up to a 2^-64
birthday bound at 2^32 rows: a wrong reuse is practically impossible. A changed model version
(even with byte-identical files: a python model's class name is not in its sha256), params or output
schema changes every key, so nothing is reused.

**The lookup.** An earlier run's keys sit in one key file per part (``_reuse/<part>.keys.parquet``,
row ``i`` = row ``i`` of the part). ``reuse_match.py`` matches them with the input's keys before Ray
starts, in hash-partitioned spill files one partition at a time, and writes the input again with
each row's key and earlier place; without an earlier run, :func:`key_batch` keys each read block in
a Ray task.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract.reuse import KEY_SCHEME

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

# columns a keyed block carries through the pipeline (never written into a part)
KEY_COLUMN = "__batchinfer_key"
SOURCE_PART_COLUMN = "__batchinfer_src_part"
SOURCE_ROW_COLUMN = "__batchinfer_src_row"
REUSED_COLUMN = "__batchinfer_reused"
KEY_BYTES = 16


class ReuseIndexError(RuntimeError):
    """An earlier run's key file does not match what its manifest says (bytes, rows)."""


def context_digest(
    *,
    model: str,
    model_sha256: str,
    flavor: str,
    params: Mapping[str, Any],
    inputs: Sequence[tuple[str, str, str]],
    outputs: Mapping[str, Any],
    engine: str | None,
) -> str:
    """The hex sha256 every row key of a run is keyed with: what besides the row decides its output.
    ``inputs``: (model input, input column, Arrow type) in signature order."""
    doc = {
        "scheme": KEY_SCHEME,
        "model": model,
        "model_sha256": model_sha256,
        "flavor": flavor,
        "params": params,
        "engine": engine,
        "inputs": [list(i) for i in inputs],
        "outputs": outputs,
    }
    text = json.dumps(doc, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _length(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _is_fixed_width(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))


def _fixed_width_values(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(validity bytes, little-endian values; a null's value is 0)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if column.null_count:
        valid = pc.is_valid(column).to_numpy(zero_copy_only=False).astype(np.uint8)
        column = column.fill_null(False if pa.types.is_boolean(column.type) else 0)
    else:
        valid = np.ones(len(column), np.uint8)
    values = column.to_numpy(zero_copy_only=False)
    if values.dtype.byteorder == ">":
        values = values.astype(values.dtype.newbyteorder("<"))
    return valid, values


def _fixed_width_matrix(columns: list[pa.Array]) -> np.ndarray:
    """One ``rows x width`` byte row per table row: every column's validity byte, then the values,
    grouped by dtype in order of first appearance (a layout fixed by the column types). Built by
    stacking whole columns and transposing once: column-by-column strided writes are 10x slower."""
    import numpy as np

    valids: list[np.ndarray] = []
    groups: dict[str, list[np.ndarray]] = {}
    for column in columns:
        valid, values = _fixed_width_values(column)
        valids.append(valid)
        groups.setdefault(values.dtype.str, []).append(values)
    blocks = [np.ascontiguousarray(np.vstack(valids).T)]
    for arrays in groups.values():
        stacked = np.ascontiguousarray(np.vstack(arrays).T)
        blocks.append(stacked.view(np.uint8).reshape(stacked.shape[0], -1))
    return np.ascontiguousarray(np.hstack(blocks))


def _column_pieces(column: pa.Array) -> list[bytes]:
    """One canonical byte string per value of a variable-width column: tag + length + bytes; a null
    is ``b"\x00"``. Text is UTF-8; nested values are canonical JSON (float repr round-trips)."""
    import pyarrow as pa

    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return [
            b"\x00" if v is None else b"\x01" + _length(len(b := v.encode("utf-8"))) + b for v in column.to_pylist()
        ]
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        return [b"\x00" if v is None else b"\x02" + _length(len(v)) + v for v in column.to_pylist()]
    return [
        b"\x00" if v is None else b"\x04" + _length(len(b := json.dumps(v, sort_keys=True, default=repr).encode())) + b
        for v in column.to_pylist()
    ]


def _digest(h: Any, piece: bytes) -> bytes:
    h.update(piece)
    return bytes(h.digest())


def row_keys(table: pa.Table, columns: Sequence[str], context: str) -> bytes:
    """The 16-byte key of every row of ``table`` over ``columns``, concatenated (``rows * 16`` bytes).

    Variable-width columns hash as length-prefixed pieces in column order; the fixed-width (numeric,
    boolean) ones as one row of their validity bytes and values after them, so a 64-feature row
    costs one hash update, not 64. The layout is fixed by the columns and types (in the context)."""
    import pyarrow as pa

    base = hashlib.blake2b(digest_size=KEY_BYTES, key=bytes.fromhex(context))
    pieces: list[list[bytes]] = []
    fixed = []
    for name in columns:
        column = table.column(name)
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if _is_fixed_width(column.type):
            fixed.append(column)
        else:
            pieces.append(_column_pieces(column))
    if fixed:
        matrix = _fixed_width_matrix(fixed)
        width, data = matrix.shape[1], matrix.tobytes()
        pieces.append([data[i : i + width] for i in range(0, len(data), width)] if width else [])
    if len(pieces) == 1:  # the common case: one text column, or only numbers
        copy = base.copy
        return b"".join([_digest(copy(), piece) for piece in pieces[0]])
    out = bytearray()
    for row in zip(*pieces, strict=True):
        h = base.copy()
        for piece in row:
            h.update(piece)
        out += h.digest()
    return bytes(out)


def key_array(keys: bytes) -> pa.Array:
    import pyarrow as pa

    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(KEY_BYTES), len(keys) // KEY_BYTES, [None, pa.py_buffer(keys)]
    )


def key_batch(batch: pa.Table, columns: list[str], context: str) -> pa.Table:
    """A Ray Data ``map_batches`` function (fused with the read): the block with each row's key, and
    no earlier place (part index -1: score it). Used when no earlier run is reused."""
    import numpy as np
    import pyarrow as pa

    n = batch.num_rows
    return (
        batch.append_column(KEY_COLUMN, key_array(row_keys(batch, columns, context)))
        .append_column(SOURCE_PART_COLUMN, pa.array(np.full(n, -1, np.int32)))
        .append_column(SOURCE_ROW_COLUMN, pa.array(np.zeros(n, np.int64)))
    )
