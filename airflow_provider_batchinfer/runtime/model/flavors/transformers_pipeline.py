"""A Hugging Face ``pipeline`` of a text or file task, loaded from the logged directory, never a hub.

Every task's output is flattened into typed Arrow columns (``registry/pipelines.py`` lists them):
a label and its score, a list of entity structs, a list of token vectors, a string. Rows are sorted
by length before they are cut into model calls of ``batch_size`` (``InputSpec.params``, capped by
the job's rows per model call, ``flavors.call_rows``), so a call pads little, and put back in order after. Parameters other
than ``batch_size`` go to the pipeline call (``top_k``, ``candidate_labels``, ``aggregation_strategy``,
``chunk_length_s``...) or, for the text-to-text tasks, to ``generate`` (``max_new_tokens``,
``num_beams``...). Audio arrives as the bytes of a WAV file (``column_handling={"path": "bytes"}``).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.pipelines import SEQ2SEQ_TASKS, canonical_task
from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor

DEFAULT_BATCH_SIZE = 32
_COMPONENTS = ("tokenizer", "feature_extractor", "image_processor", "processor")


def decode_wav(data: Any, column: str, rate: int) -> dict[str, Any]:
    """PCM WAV bytes -> ``{"raw": float32 mono samples, "sampling_rate": rate}`` at the model's rate."""
    import wave

    import numpy as np

    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(
            f"column {column!r}: expected the bytes of a WAV file, got {type(data).__name__}; for file locations set "
            f"InputSpec.column_handling={{{column!r}: 'bytes'}}"
        )
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, channels, file_rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"column {column!r}: {len(data)} bytes that are not a PCM WAV file ({exc})") from None
    samples: Any
    if width == 1:
        samples = (np.frombuffer(frames, np.uint8).astype(np.float32) - 128) / 128
    elif width in (2, 4):
        kind = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(frames, f"<i{width}").astype(np.float32) / float(np.iinfo(kind).max)
    else:
        raise ValueError(f"column {column!r}: {8 * width}-bit WAV is not supported; write 16-bit PCM")
    samples = samples.reshape(-1, channels).mean(axis=1) if channels > 1 else samples
    if file_rate != rate:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(file_rate, rate)
        samples = resample_poly(samples, rate // g, file_rate // g).astype(np.float32)
    return {"raw": samples, "sampling_rate": rate}


def _by_length(values: list[Any]) -> list[int]:
    return sorted(range(len(values)), key=lambda i: len(values[i]) if values[i] is not None else 0)


def _unpad(tokenizer: Any, texts: list[str], results: list[Any]) -> list[Any]:
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True)["input_ids"]]
    left = getattr(tokenizer, "padding_side", "right") == "left"
    out = []
    for n, r in zip(lengths, results, strict=True):
        r = r[0] if hasattr(r, "shape") and len(r.shape) == 3 else r
        out.append(r[-n:] if left else r[:n])
    return out


def _flatten(task: str, results: list[Any], outputs: dict[str, str]) -> dict[str, Any]:
    """The pipeline's per-row results as the signature's typed columns."""
    import pyarrow as pa

    scored = pa.list_(pa.struct([("label", pa.string()), ("score", pa.float32())]))
    out: dict[str, Any] = {}
    if task == "text-classification":
        rows = [r if isinstance(r, list) else [r] for r in results]
        out["label"] = pa.array([r[0]["label"] for r in rows], pa.string())
        out["score"] = pa.array([float(r[0]["score"]) for r in rows], pa.float32())
        if "top_k" in outputs:
            out["top_k"] = pa.array(
                [[{"label": d["label"], "score": float(d["score"])} for d in r] for r in rows], scored
            )
    elif task == "zero-shot-classification":
        out["label"] = pa.array([r["labels"][0] for r in results], pa.string())
        out["score"] = pa.array([float(r["scores"][0]) for r in results], pa.float32())
        out["labels"] = pa.array([r["labels"] for r in results], pa.list_(pa.string()))
        out["scores"] = pa.array([[float(s) for s in r["scores"]] for r in results], pa.list_(pa.float32()))
    elif task == "token-classification":
        fields = [("entity", pa.string()), ("score", pa.float32()), ("word", pa.string())]
        fields += [("start", pa.int64()), ("end", pa.int64())]
        out["entities"] = pa.array(
            [
                [
                    {
                        "entity": e.get("entity_group", e.get("entity")),
                        "score": float(e["score"]),
                        "word": e["word"],
                        "start": e.get("start"),
                        "end": e.get("end"),
                    }
                    for e in r
                ]
                for r in results
            ],
            pa.list_(pa.struct(fields)),
        )
    elif task == "feature-extraction":
        out["embedding"] = pa.array(
            [v.float().numpy().tolist() if hasattr(v, "numpy") else v for v in results],
            pa.list_(pa.list_(pa.float32())),
        )
    elif task == "automatic-speech-recognition":
        out["text"] = pa.array([r["text"] for r in results], pa.string())
    return {name: out[name] for name in outputs}


def _pipeline_predictor(
    path: str, task: str, device: str, outputs: dict[str, str], step: int, components: dict[str, str]
):
    from transformers import pipeline

    pipe = pipeline(
        task,
        model=path,
        device=device,
        trust_remote_code=False,  # offline: HF_HUB_OFFLINE is set before transformers is imported
        **components,
    )
    rate = getattr(getattr(pipe, "feature_extractor", None), "sampling_rate", 16000)

    def predict(values: list[Any], column: str, params: dict[str, Any]) -> dict[str, Any]:
        kwargs = {k: v for k, v in params.items() if k != "batch_size"}
        # a CTC model's padded frames leak into a clip's last characters: one clip per call unless
        # the author asks for batches, so a transcript never depends on which clips share a batch
        default = 1 if task == "automatic-speech-recognition" else step
        batch_size = min(int(params.get("batch_size", default)), step)
        if task == "zero-shot-classification" and not kwargs.get("candidate_labels"):
            raise ValueError(
                "a zero-shot-classification model needs its labels: InputSpec(params={'candidate_labels': [...]})"
            )
        if task == "text-classification" and "top_k" in outputs:
            kwargs.setdefault("top_k", None)  # every label, best first
        if task == "token-classification":
            kwargs.setdefault("aggregation_strategy", "simple")
        if task == "automatic-speech-recognition":
            values = [decode_wav(v, column, rate) for v in values]
            order = sorted(range(len(values)), key=lambda i: len(values[i]["raw"]))
        else:
            for v in values:
                if not isinstance(v, str):
                    raise ValueError(f"column {column!r}: expected text, got {type(v).__name__}")
            order = _by_length(values)
        if task == "feature-extraction":
            kwargs.setdefault("return_tensors", True)
            kwargs.setdefault("tokenize_kwargs", {"truncation": True})  # a long text: its first max_length tokens
        if task == "text-classification":
            kwargs.setdefault("truncation", True)
        results = pipe([values[i] for i in order], batch_size=batch_size, **kwargs) if values else []
        if isinstance(results, dict):
            results = [results]
        if task == "feature-extraction":  # a batched call pads: keep each text's own tokens only
            results = _unpad(pipe.tokenizer, [values[i] for i in order], results)
        unsorted: list[Any] = [None] * len(values)
        for pos, i in enumerate(order):
            unsorted[i] = results[pos]
        return _flatten(task, unsorted, outputs)

    return predict


def _seq2seq_predictor(path: str, tokenizer_path: str | None, device: str, outputs: dict[str, str], step: int):
    """Summarization, translation, text2text: ``generate`` on length-sorted batches (the pipelines
    for these tasks left transformers in v5)."""
    import pyarrow as pa
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path, local_files_only=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(path, local_files_only=True).to(device).eval()
    (out_col,) = list(outputs)

    def predict(values: list[Any], column: str, params: dict[str, Any]) -> dict[str, Any]:
        for v in values:
            if not isinstance(v, str):
                raise ValueError(f"column {column!r}: expected text, got {type(v).__name__}")
        batch_size = min(int(params.get("batch_size", step)), step)
        prefix = str(params.get("prefix", getattr(model.config, "prefix", None) or ""))
        gen = {k: v for k, v in params.items() if k not in ("batch_size", "prefix")}
        order = _by_length(values)
        texts: list[str] = [""] * len(values)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                enc = tokenizer(
                    [prefix + values[i] for i in idx],
                    padding=True,
                    truncation=True,
                    return_tensors="pt",
                    return_token_type_ids=False,
                ).to(device)
                decoded = tokenizer.batch_decode(model.generate(**enc, **gen), skip_special_tokens=True)
                for i, text in zip(idx, decoded, strict=True):
                    texts[i] = text.strip()
        return {out_col: pa.array(texts, pa.string())}

    return predict


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    options = manifest["options"]
    path = str(model_dir / options["dir"])
    task = canonical_task(options["task"])
    outputs = manifest["signature"]["outputs"]
    (column,) = list(manifest["signature"]["inputs"])
    step = max_rows or DEFAULT_BATCH_SIZE
    if task in SEQ2SEQ_TASKS:
        tokenizer = options.get("tokenizer")
        run = _seq2seq_predictor(path, str(model_dir / tokenizer) if tokenizer else None, device, outputs, step)
    else:
        # an MLflow transformers model keeps its tokenizer / processor beside the model, not in it
        components = {k: str(model_dir / options[k]) for k in _COMPONENTS if options.get(k)}
        run = _pipeline_predictor(path, task, device, outputs, step, components)

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        return run(inputs.column(column).to_pylist(), column, params)

    return predict


# more rows per replica batch than a model call: length-sorted model calls pad less
FLAVOR = Flavor(name="transformers_pipeline", load=load, transfer_rows=1024)
