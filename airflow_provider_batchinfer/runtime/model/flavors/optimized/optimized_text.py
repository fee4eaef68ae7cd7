"""The optimized backend for sentence-transformers models: ONNX Runtime, fp32 or dynamic INT8.

Why: on CPU, a MiniLM-sized encoder spends nearly all its time in the transformer's matrix products.
Exported once to ONNX and quantized to INT8 weights (``onnxruntime.quantization.quantize_dynamic``,
per channel), the same model runs several times faster than in PyTorch; and a replica that loads
a cached export never imports torch (2-3 s saved per job start, onnxruntime imports in ~0.2 s).

Chosen per job with ``JobSpec(backend="onnx" | "onnx_int8")`` (validated when the DAG is parsed).
The export happens once per model version and backend: it is cached on the node under
``<model cache>/optimized/<sha256>/<backend>-v<FORMAT>/`` (the model cache of ``registry/fetch.py``;
content-addressed, so versions never collide), built in a temporary directory and renamed into place
under a file lock, so concurrent replicas export it once and never read a half-written one.

The accuracy guard: at export time the optimized model's embeddings are compared with PyTorch's on
a fixed sample of texts of every length; the mean cosine similarity (and the least one) is stored
beside the export. A job whose ``JobSpec.backend_min_cosine`` (default 0.99) is above that mean is
refused before any row is scored, with the figures and what to do. The check is repeated on every
load from the stored figure, so a later job with a stricter threshold is refused too.

Supported: models made of a Hugging Face ``Transformer`` module, a ``Pooling`` module (mean, CLS or
max) and optionally ``Normalize`` (all-MiniLM-L6-v2, all-mpnet-base-v2, the BGE and E5 families).
Others (a ``Dense`` head, a custom module) are refused with a message naming the modules.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from airflow_provider_batchinfer.runtime.model.flavors.optimized import optimized_cache
from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_cache import (
    BackendRefusedError,
    check_guard,
    cosines,
    has_files,
    quantize_int8,
)
from airflow_provider_batchinfer.runtime.model.flavors.protocol import OptimizedBackend

__all__ = [
    "BACKEND",
    "CONCURRENT_CALLS",
    "BackendRefusedError",
    "OrtEncoder",
    "export",
    "load",
    "optimized_dir",
    "prepare",
]

#: In the driver (``runtime/engine/in_driver.py``) the encoder is loaded with one ONNX Runtime thread and
#: called from as many threads as the job has, each call on its own batch: ``InferenceSession.run``
#: is thread-safe, and one-thread calls never wait for each other. One call on two threads syncs
#: them at every operator of a small matrix product (32 texts x ~30 tokens x 384), so any other
#: thread on the two cores (the reader, the writer, the Airflow task's process) stalls both.
#: MiniLM INT8 on 2 cores, 2,000 texts in batches of 1,000, five runs each: 214 rows/s (median) as
#: two one-thread calls against 187 as one two-thread call; with the eager export, 229 against 206.
#: A 10,000-text job end to end (both changes): 211 and 213 rows/s against 156 and 181 before.
CONCURRENT_CALLS = True

FORMAT = 2  # 2: eager attention in the export (1: the model's default attention)
SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")
POOLING = ("mean", "cls", "max")
SAMPLE_ROWS = 48  # texts in the accuracy sample: a few seconds of PyTorch at export time, once


def sample_texts(rows: int = SAMPLE_ROWS) -> list[str]:
    """A fixed, varied sample: short queries to ~300-word passages (truncation included)."""
    words = [
        "the",
        "a",
        "of",
        "to",
        "and",
        "in",
        "is",
        "it",
        "that",
        "for",
        "on",
        "was",
        "with",
        "as",
        "by",
        "at",
        "from",
        "this",
        "be",
        "or",
        "are",
        "an",
        "not",
        "have",
        "but",
        "order",
        "invoice",
        "refund",
        "shipping",
        "delayed",
        "account",
        "password",
        "login",
        "error",
        "timeout",
        "cluster",
        "region",
        "model",
        "training",
        "data",
        "pipeline",
        "batch",
        "inference",
        "weather",
        "river",
        "mountain",
        "music",
        "history",
        "science",
        "please",
        "help",
        "urgent",
        "customer",
        "support",
        "database",
        "migration",
        "latency",
        "network",
        "storage",
        "report",
    ]
    rng = random.Random(18)
    lengths = [3, 5, 8, 12, 20, 32, 50, 80, 130, 300]
    return [" ".join(rng.choice(words) for _ in range(lengths[i % len(lengths)])) for i in range(rows)]


def optimized_dir(cache_root: Path, sha256: str, backend: str) -> Path:
    return optimized_cache.optimized_dir(cache_root, sha256, backend, FORMAT)


# --- export (once per model version and backend; needs torch and sentence-transformers) ------------------------
def _structure(st: Any) -> tuple[str, bool]:
    """(pooling mode, normalize) of a Transformer + Pooling (+ Normalize) model, else refused."""
    names = [type(m).__name__ for m in st]
    if len(names) < 2 or names[0] != "Transformer" or names[1] != "Pooling" or names[2:] not in ([], ["Normalize"]):
        raise BackendRefusedError(
            f"the optimized backend runs sentence-transformers models made of Transformer + Pooling (+ Normalize); "
            f"this one is {' + '.join(names)}. Run it with JobSpec(backend=None) (PyTorch)"
        )
    config = st[1].get_config_dict()
    mode = config.get("pooling_mode")
    if mode is None:  # sentence-transformers < 6 writes one flag per mode
        flags = [
            m for m in POOLING if config.get(f"pooling_mode_{m}_tokens" if m != "cls" else "pooling_mode_cls_token")
        ]
        mode = flags[0] if len(flags) == 1 else ",".join(flags) or "none"
    if mode not in POOLING:
        raise BackendRefusedError(
            f"the optimized backend pools with {list(POOLING)}; this model pools with {mode!r}. "
            "Run it with JobSpec(backend=None) (PyTorch)"
        )
    return str(mode), names[2:] == ["Normalize"]


def _wrapper(hf_model: Any, mode: str, normalize: bool) -> Any:
    import torch

    class SentenceEmbedding(torch.nn.Module):
        """The transformer, pooling and normalization as one graph: what ONNX Runtime runs."""

        def __init__(self) -> None:
            super().__init__()
            self.hf = hf_model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            hidden = self.hf(**kwargs).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            if mode == "cls":
                pooled = hidden[:, 0]
            elif mode == "max":
                pooled = (hidden - (1.0 - mask) * 1e9).max(dim=1).values
            else:
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1) if normalize else pooled

    return SentenceEmbedding().eval()


def _export_onnx(st: Any, mode: str, normalize: bool, path: Path) -> list[str]:
    import torch

    tokenizer = st[0].tokenizer
    features = tokenizer(["an example", "a second, longer example text"], padding=True, return_tensors="pt")
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in features]
    args = tuple(features[n] for n in names)
    dynamic = {n: {0: "batch", 1: "tokens"} for n in names} | {"sentence_embedding": {0: "batch"}}
    with torch.inference_mode():
        torch.onnx.export(
            _wrapper(st[0].auto_model, mode, normalize),
            args,
            str(path),
            input_names=names,
            output_names=["sentence_embedding"],
            dynamic_axes=dynamic,
            opset_version=17,
            dynamo=False,  # the TorchScript exporter: one self-contained file, ~3 s for MiniLM
        )
    return names


def export(model_dir: Path, backend: str, target: Path) -> dict[str, Any]:
    """Export the model at ``model_dir`` for ``backend`` into ``target`` (a fresh directory) and
    measure it against PyTorch on the sample; the figures (``info.json``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    started = time.monotonic()
    # eager attention: exported as plain products and a softmax. PyTorch's fused attention (the
    # default) exports with a NaN guard per layer (IsNaN, Where, more shape arithmetic: 820 nodes
    # against 667 for MiniLM-L6), which ONNX Runtime ran ~10% slower on CPU; the numbers are the same
    st = SentenceTransformer(
        str(model_dir), device="cpu", local_files_only=True, model_kwargs={"attn_implementation": "eager"}
    )
    mode, normalize = _structure(st)
    fp32 = target / ("model.onnx" if backend == "onnx" else "model-fp32.onnx")
    inputs = _export_onnx(st, mode, normalize, fp32)
    reduced = quantize_int8(fp32, target / "model.onnx") if backend == "onnx_int8" else False
    st[0].tokenizer.backend_tokenizer.save(str(target / "tokenizer.json"))
    info: dict[str, Any] = {
        "format": FORMAT,
        "backend": backend,
        "inputs": inputs,
        "max_seq_length": int(st.max_seq_length),
        "pooling": mode,
        "normalize": normalize,
        "reduce_range": reduced,
        "dimension": int(
            getattr(st, "get_embedding_dimension", getattr(st, "get_sentence_embedding_dimension", lambda: 0))() or 0
        ),
    }
    (target / "info.json").write_text(json.dumps(info))
    texts = sample_texts()
    reference = st.encode(texts, batch_size=16, convert_to_numpy=True, show_progress_bar=False)
    mine = OrtEncoder(target, threads=max(1, os.cpu_count() or 1)).encode(texts, batch_size=16)
    cosine = cosines(reference, mine)
    info.update(
        cosine_mean=round(float(cosine.mean()), 6),
        cosine_min=round(float(cosine.min()), 6),
        sample_rows=len(texts),
        export_s=round(time.monotonic() - started, 2),
    )
    (target / "info.json").write_text(json.dumps(info))
    return info


def prepare(model_dir: Path, sha256: str, backend: str, cache_root: Path) -> tuple[Path, dict[str, Any], bool]:
    """The cached export of this model version for ``backend``, made now when missing: (its
    directory, its ``info.json``, whether this call exported it). Concurrent replicas on one node
    export once: the others wait on the lock and find it done (``optimized_cache.prepare``)."""
    return optimized_cache.prepare(
        optimized_dir(cache_root, sha256, backend),
        lambda work: export(model_dir, backend, work),
        lambda target: has_files(target, "model.onnx", "tokenizer.json"),
    )


# --- inference (no torch) ------------------------------------------------------------------------------------
class OrtEncoder:
    """Tokenizes with the model's own fast tokenizer (``tokenizers``, no torch) and runs the
    exported graph. Texts are sorted by token count and cut into model calls of ``batch_size``,
    each padded only to its own longest text (sentence-transformers sorts by characters)."""

    def __init__(self, directory: Path, threads: int, use_cuda: bool = False) -> None:
        from tokenizers import Tokenizer

        from airflow_provider_batchinfer.runtime.model.ort import ort_session

        self.info = json.loads((directory / "info.json").read_text())
        self.session = ort_session(directory / "model.onnx", intra_op_threads=threads, use_cuda=use_cuda)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=int(self.info["max_seq_length"]))
        self.inputs = list(self.info["inputs"])

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        encodings = self.tokenizer.encode_batch_fast(texts)  # no offsets: 0.26 against 0.32 s per 4,096 texts
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        order = np.argsort(-lengths, kind="stable")
        out: np.ndarray | None = None
        for start in range(0, len(texts), max(1, batch_size)):
            rows = order[start : start + batch_size]
            width = int(lengths[rows].max()) if len(rows) else 0
            feed = {name: np.zeros((len(rows), width), dtype=np.int64) for name in self.inputs}
            for r, i in enumerate(rows):
                e, n = encodings[i], int(lengths[i])
                feed["input_ids"][r, :n] = e.ids
                feed["attention_mask"][r, :n] = 1
                if "token_type_ids" in feed:
                    feed["token_type_ids"][r, :n] = e.type_ids
            (emb,) = self.session.run(["sentence_embedding"], feed)
            if out is None:
                out = np.empty((len(texts), emb.shape[1]), dtype=np.float32)
            out[rows] = emb
        return out if out is not None else np.empty((0, int(self.info.get("dimension") or 0)), dtype=np.float32)


def load(
    model_dir: Path,
    manifest: dict[str, Any],
    device: str,
    threads: int,
    max_rows: int | None = None,
    *,
    backend: str,
    min_cosine: float = 0.99,
    cache_root: Path,
    say: Callable[[str], None] = print,
) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """A predictor with the sentence-transformers flavor's shape, running on ONNX Runtime."""
    from airflow_provider_batchinfer.runtime.model.flavors.sentence_transformers import CPU_CALL_ROWS, encode_batch_size

    model = f"{manifest['name']}/{manifest['version']}"  # the flavor was checked by flavors.load_optimized
    directory, info, exported = prepare(model_dir / manifest["options"]["dir"], manifest["sha256"], backend, cache_root)
    check_guard(info, min_cosine, model, f"embeddings on {info['sample_rows']} sample texts")
    say(
        f"[batchinfer] backend {backend}: {'exported in ' + str(info['export_s']) + 's' if exported else 'cached export'} "
        f"at {directory}; accuracy guard: mean cosine {info['cosine_mean']:.4f} (least {info['cosine_min']:.4f}) "
        f">= {min_cosine:g}"
    )
    encoder = OrtEncoder(directory, threads, use_cuda=device == "cuda")
    (text_col,) = list(manifest["signature"]["inputs"]) or ["text"]
    (out_col,) = list(manifest["signature"]["outputs"]) or ["embedding"]

    def predict(inputs: Any, params: dict[str, Any]) -> dict[str, Any]:
        batch_size = encode_batch_size(params, max_rows or CPU_CALL_ROWS)  # the flavor's own rule
        embeddings = encoder.encode(inputs.column(text_col).to_pylist(), batch_size)
        if params.get("normalize_embeddings"):
            embeddings /= np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
        return {out_col: embeddings}

    return predict


BACKEND = OptimizedBackend(flavor="sentence_transformers", load=load, concurrent_calls=CONCURRENT_CALLS)
