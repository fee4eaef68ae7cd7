"""sentence-transformers models, loaded from the logged directory (never from a hub)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor
from airflow_provider_batchinfer.runtime.model.flavors.sentence_gpu import fast_features, overlapped_encode

# SentenceTransformer.encode sorts its input by length and cuts it into model calls of
# ``batch_size`` texts: the more texts one call of encode sees, the less each model call pads.
# the benchmark's 20k tickets in calls of 32 pad to 37.4 tokens a text sorted within 1,024,
# 36.0 within 4,096, 35.8 over all of them (31.3 unpadded). 4,096 against 1,024, interleaved, two
# runs each on 2 cores: PyTorch 130.6 and 130.0 rows/s against 123.0 and 120.7 (raw loop 147.1);
# onnx_int8 291 and 262 against 260 and 243. A batch takes ~30 s on 2 cores: progress and RESUME
# move in steps of that size.
TRANSFER_ROWS = 4096
# On a GPU a call holds 256 texts by default (``Tuning.call_rows``): a 1,024-text batch sorted 4
# calls' worth and padded MiniLM's calls to 65.9 tokens a text where a sort over 8,192 texts pads to
# 39.3 (all 100k texts: 37.4; the H100 profile, ``docs/gpu.md``). 32 calls a batch.
GPU_TRANSFER_ROWS = 8192
# on CPU, texts per call when the job leaves JobSpec.max_batch_rows unset: encode's own default
CPU_CALL_ROWS = 32


def encode_batch_size(params: dict[str, Any], max_rows: int) -> int:
    """Texts per model call: ``params["batch_size"]`` if the job names one, never above
    ``max_rows`` (the job's rows per model call, ``flavors.call_rows``), else ``max_rows``.

    By default that is encode's own 32 on CPU (``CPU_CALL_ROWS``) and 256 on a GPU, where a call of
    32 short texts is a few hundred small kernel launches that leave the GPU idle while the
    replica launches them (``docs/gpu.md``)."""
    if "batch_size" in params:
        return max(1, min(int(params["batch_size"]), max_rows))
    return max_rows


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    rows = max_rows or CPU_CALL_ROWS  # the runtime always passes the resolved rows; a bare call gets encode's
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir / manifest["options"]["dir"]), device=device, local_files_only=True)
    (text_col,) = list(manifest["signature"]["inputs"]) or ["text"]
    (out_col,) = list(manifest["signature"]["outputs"]) or ["embedding"]

    tokenize = None if device == "cpu" else fast_features(model)
    if device != "cpu":
        print(
            f"[batchinfer] sentence_transformers on {device}: "
            + (
                "tokenizing overlapped with the model calls (fast tokenizer backend)"
                if tokenize
                else "SentenceTransformer.encode (the fast tokenizing path does not apply to this model)"
            ),
            flush=True,
        )

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        texts = inputs.column(text_col).to_pylist()
        batch_size = encode_batch_size(params, rows)
        normalize = bool(params.get("normalize_embeddings", False))
        if tokenize is not None:
            return {out_col: overlapped_encode(model, texts, tokenize, batch_size, normalize, device)}
        embeddings = model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=normalize,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return {out_col: embeddings}

    return predict


FLAVOR = Flavor(
    name="sentence_transformers",
    load=load,
    transfer_rows=TRANSFER_ROWS,
    gpu_transfer_rows=GPU_TRANSFER_ROWS,
    cpu_call_rows=CPU_CALL_ROWS,
    call_rows_param="batch_size",
    optimized="airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_text",
)
