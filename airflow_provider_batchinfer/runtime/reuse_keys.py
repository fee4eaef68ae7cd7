"""Content keys for incremental scoring, and the partitioned lookup of an earlier run's keys.

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
row ``i`` = row ``i`` of the part). They are loaded into ``KeyShard`` actors (``num_cpus=0``),
hash-partitioned by the key's first 64 bits, about :data:`ROWS_PER_SHARD` keys each (28 bytes a
key: 10 M keys are 280 MB spread over 3 actors, which Ray may place on any node); the Airflow
worker and the job's driver never hold them. Each read block computes its keys in a Ray task and
asks the shards, one call per shard, where each key was (part, row) or that it is new.
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
ROWS_PER_SHARD = 4_000_000


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


def split_keys(keys: bytes | pa.Buffer | memoryview, count: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(first 64 bits, last 64 bits) of ``count`` packed 16-byte keys, as two uint64 arrays."""
    import numpy as np

    pairs = np.frombuffer(keys, dtype="<u8", count=2 * count, offset=offset * KEY_BYTES).reshape(count, 2)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def key_array(keys: bytes) -> pa.Array:
    import pyarrow as pa

    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(KEY_BYTES), len(keys) // KEY_BYTES, [None, pa.py_buffer(keys)]
    )


def shard_count(indexed_rows: int) -> int:
    return max(1, -(-indexed_rows // ROWS_PER_SHARD))


class KeyShard:
    """One hash partition of an earlier run's keys: (hi, lo) sorted, with where each row was. A Ray
    actor with ``num_cpus=0``: it holds memory, not compute."""

    def __init__(self, shard: int, shards: int) -> None:
        self.shard, self.shards = shard, shards
        self.hi: Any = None
        self.lo: Any = None
        self.part: Any = None
        self.row: Any = None

    def load(self, files: Sequence[tuple[int, str, int, str]], storage: Mapping[str, Any] | None) -> int:
        """Read every key file ``(part index, location, rows, sha256)``, verify its sha256 and rows,
        keep this shard's keys; returns how many it holds."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        from airflow_provider_batchinfer.stage import Stage

        his, los, parts, rows = [], [], [], []
        for part_index, location, count, sha256 in files:
            data = Stage.open(location, dict(storage) if storage else None).read_bytes()
            actual = hashlib.sha256(data).hexdigest()
            if actual != sha256:
                raise ReuseIndexError(f"{location} does not match its sha256 in the earlier run's _SUCCESS")
            column = pq.read_table(pa.BufferReader(data), columns=["key"]).column("key").combine_chunks()
            if len(column) != count:
                raise ReuseIndexError(
                    f"{location} holds {len(column)} keys but the earlier run's _SUCCESS says {count}"
                )
            hi, lo = split_keys(column.buffers()[1], len(column), column.offset)
            mine = np.nonzero(hi % np.uint64(self.shards) == self.shard)[0]
            his.append(hi[mine])
            los.append(lo[mine])
            parts.append(np.full(len(mine), part_index, np.int32))
            rows.append(mine.astype(np.int64))
        hi, lo = np.concatenate(his or [np.zeros(0, np.uint64)]), np.concatenate(los or [np.zeros(0, np.uint64)])
        order = np.lexsort((lo, hi))
        self.hi, self.lo = hi[order], lo[order]
        self.part = np.concatenate(parts or [np.zeros(0, np.int32)])[order]
        self.row = np.concatenate(rows or [np.zeros(0, np.int64)])[order]
        return len(self.hi)

    def lookup(self, hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part index or -1, row) of each key: vectorized on the first 64 bits, the last 64 checked."""
        import numpy as np

        left = np.searchsorted(self.hi, hi, side="left")
        right = np.searchsorted(self.hi, hi, side="right")
        part = np.full(len(hi), -1, np.int32)
        row = np.zeros(len(hi), np.int64)
        for i in np.nonzero(right > left)[0]:  # candidates: usually exactly one per key
            for j in range(left[i], right[i]):
                if self.lo[j] == lo[i]:
                    part[i], row[i] = self.part[j], self.row[j]
                    break
        return part, row


def key_batch(batch: pa.Table, columns: list[str], context: str, shards: list[Any] | None) -> pa.Table:
    """A Ray Data ``map_batches`` function (fused with the read): the block with each row's key and,
    when an earlier run is reused, where its predictions are (part index, row; -1: score it)."""
    import numpy as np
    import pyarrow as pa

    n = batch.num_rows
    keys = row_keys(batch, columns, context)
    part = np.full(n, -1, np.int32)
    row = np.zeros(n, np.int64)
    if shards and n:
        import ray

        hi, lo = split_keys(keys, n)
        bucket = hi % np.uint64(len(shards))
        asks = []
        for b, shard in enumerate(shards):
            idx = np.nonzero(bucket == b)[0]
            if len(idx):
                asks.append((idx, shard.lookup.remote(hi[idx], lo[idx])))
        for idx, ref in asks:
            found_part, found_row = ray.get(ref)
            part[idx], row[idx] = found_part, found_row
    return (
        batch.append_column(KEY_COLUMN, key_array(keys))
        .append_column(SOURCE_PART_COLUMN, pa.array(part))
        .append_column(SOURCE_ROW_COLUMN, pa.array(row))
    )
