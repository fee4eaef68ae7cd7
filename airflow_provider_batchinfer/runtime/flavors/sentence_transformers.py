"""sentence-transformers models, loaded from the logged directory (never from a hub)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# SentenceTransformer.encode sorts its input by length and cuts it into model calls of
# ``batch_size`` texts: the more texts one call of encode sees, the less each model call pads.
TRANSFER_ROWS = 1024
DEFAULT_BATCH_SIZE = 32  # encode's own default


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir / manifest["options"]["dir"]), device=device, local_files_only=True)
    (text_col,) = list(manifest["signature"]["inputs"]) or ["text"]
    (out_col,) = list(manifest["signature"]["outputs"]) or ["embedding"]

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        texts = inputs.column(text_col).to_pylist()
        batch_size = int(params.get("batch_size", DEFAULT_BATCH_SIZE))
        if max_rows:
            batch_size = min(batch_size, max_rows)
        embeddings = model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=bool(params.get("normalize_embeddings", False)),
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return {out_col: embeddings}

    return predict
