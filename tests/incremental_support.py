"""Models and inputs for tests/e2e/test_incremental.py and benchmarks/incremental.py, built in-process."""

from __future__ import annotations

import os
import uuid
import zlib
from pathlib import Path


class TextFingerprint:
    """A plain Python model whose outputs depend on every character of the text (a length and a
    CRC-32 with ``salt``), so a row reused by mistake shows in a row-for-row comparison; the text
    ``boom`` makes its batch raise (for dead-lettering). With
    ``tally`` (a directory), each call leaves a file holding how many rows it scored: the rows that
    really reached the model, counted outside the provider."""

    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch, salt: str = "", tally: str | None = None):
        import numpy as np

        texts = batch["text"].tolist()
        if "boom" in texts:
            raise ValueError(f"cannot score text 'boom' (row {texts.index('boom')} of the batch)")
        if tally:
            Path(tally, uuid.uuid4().hex).write_text(str(len(texts)))
        return {
            "length": np.array([len(t) for t in texts], np.int64),
            "crc": np.array([zlib.crc32((salt + t).encode()) for t in texts], np.int64),
        }


SIGNATURE = {"inputs": {"text": "string"}, "outputs": {"length": "int64", "crc": "int64"}}


def product_texts(rows: int, changed_every: int = 0, version: int = 1) -> dict[int, str]:
    """``{id: text}`` for ``rows`` products; with ``changed_every``, every such id has a new text."""
    texts = {}
    for i in range(rows):
        text = f"product {i}: " + "steel bolt, zinc plated " * (i % 5) + f"size {i % 97}"
        if changed_every and i % changed_every == 0:
            text += f" (revised v{version})"
        texts[i] = text
    return texts


def write_products(directory: Path, texts: dict[int, str], files: int = 2) -> Path:
    """Write ``{id: text}`` as ``files`` Parquet files (columns ``product_id``, ``text``, ``price``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    ids = sorted(texts)
    table = pa.table(
        {
            "product_id": pa.array(ids, pa.int64()),
            "text": [texts[i] for i in ids],
            "price": pa.array([float(i % 1000) / 10 for i in ids], pa.float64()),
        }
    )
    per = -(-len(ids) // files)
    for n, start in enumerate(range(0, len(ids), per)):
        pq.write_table(table.slice(start, per), directory / f"products-{n:02d}.parquet")
    return directory


def tallied(tally: str | os.PathLike) -> int:
    """Rows the model scored, from the files ``TextFingerprint`` left in ``tally``; empties it."""
    total = 0
    for f in Path(tally).iterdir():
        total += int(f.read_text())
        f.unlink()
    return total
