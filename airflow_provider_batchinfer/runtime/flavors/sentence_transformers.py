"""sentence-transformers models, loaded from the logged directory (never from a hub)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# SentenceTransformer.encode sorts its input by length and cuts it into model calls of
# ``batch_size`` texts: the more texts one call of encode sees, the less each model call pads.
TRANSFER_ROWS = 1024
DEFAULT_BATCH_SIZE = 32  # encode's own default, kept on CPU


def encode_batch_size(params: dict[str, Any], device: str, max_rows: int | None) -> int:
    """Texts per model call: ``params["batch_size"]`` if the job names one, else encode's own 32 on
    CPU and ``max_rows`` (JobSpec.max_batch_rows, 256 by default) on a GPU; never above ``max_rows``.

    Why a GPU gets larger calls: a call of 32 short texts is a few hundred small kernel launches
    that leave the GPU idle while the replica launches them (MiniLM, 100k texts, one H200, same
    run: 3,806 rows/s steady in calls of 32, 5,526 in calls of 256; ``docs/gpu.md``)."""
    default = DEFAULT_BATCH_SIZE if device == "cpu" else (max_rows or DEFAULT_BATCH_SIZE)
    batch_size = int(params.get("batch_size", default))
    return min(batch_size, max_rows) if max_rows else batch_size


def shares(lengths: list[int], parts: int) -> list[list[int]]:
    """Row positions for ``parts`` encodes of one batch: the batch sorted by length and dealt out
    in turn, so each share has the same mix of lengths (as much work) and stays as easy to pad as
    the whole batch (encode sorts each share again)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return [order[i::parts] for i in range(parts)]


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    """The predictor. On CPU with ``threads`` > 1 it encodes each batch as ``threads`` one-thread
    ``encode`` calls at a time, one per share of the batch (:func:`shares`), instead of one call
    on all threads: torch runs each operator without the GIL, and a multi-thread call syncs its
    threads at every operator of a small model, so any other thread on the cores (the reader, the
    writer, Ray's tasks) stalls them all (MiniLM, 2,000 texts, 2 cores, four interleaved runs:
    130 rows/s as two one-thread calls, 109-111 as one two-thread call). Shares of one batch,
    not batches side by side, so the last batch of a job runs on every thread too."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir / manifest["options"]["dir"]), device=device, local_files_only=True)
    # transformers sets the fast tokenizer's truncation and padding on its first call (a mutable
    # borrow of the Rust tokenizer); made here, before concurrent encodes share it, none of them
    # can meet another in flight ("RuntimeError: Already borrowed", huggingface/tokenizers#537)
    model.encode(["warm-up"], show_progress_bar=False)
    (text_col,) = list(manifest["signature"]["inputs"]) or ["text"]
    (out_col,) = list(manifest["signature"]["outputs"]) or ["embedding"]
    parts = threads if device == "cpu" and threads > 1 else 1
    pool = None
    if parts > 1:
        import torch

        torch.set_num_threads(1)  # process-wide: each concurrent encode runs on its own thread
        pool = ThreadPoolExecutor(parts, thread_name_prefix="batchinfer-encode")
        print(f"[batchinfer] sentence-transformers on CPU: {parts} one-thread encodes per batch", flush=True)

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        texts = inputs.column(text_col).to_pylist()
        batch_size = encode_batch_size(params, device, max_rows)

        def encode(chunk: list[str]) -> Any:
            return model.encode(
                chunk,
                batch_size=batch_size,
                normalize_embeddings=bool(params.get("normalize_embeddings", False)),
                convert_to_numpy=True,
                show_progress_bar=False,
            )

        if pool is None or len(texts) < parts:
            return {out_col: encode(texts)}
        import numpy as np

        positions = shares([len(t) for t in texts], parts)
        encoded = list(pool.map(lambda share: encode([texts[i] for i in share]), positions))
        embeddings = np.empty((len(texts), encoded[0].shape[1]), dtype=encoded[0].dtype)
        for share, part in zip(positions, encoded, strict=True):
            embeddings[share] = part
        return {out_col: embeddings}

    return predict
