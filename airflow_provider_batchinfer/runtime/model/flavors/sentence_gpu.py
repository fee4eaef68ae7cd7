"""sentence-transformers on a GPU: the CPU's tokenizing overlapped with the GPU's model calls.

Why (one H100, MiniLM, 100k texts; ``docs/gpu.md``): the replica's thread spent 64% of its
time tokenizing and 31% in the model, one after the other, and the GPU was busy 31% of the time.
``SentenceTransformer.encode`` tokenizes a call, runs it, and copies its embeddings back
(``.cpu()``, which waits for the GPU) before it tokenizes the next. Most of the tokenizing was not
the tokenizer: transformers turns its Python lists into tensors through a pure-Python ``flatten``
of every token (42% of the thread). Here

- texts are tokenized by the fast tokenizer's own backend (``tokenizers.Tokenizer.encode_batch``,
  Rust, on its own threads) and the ids go to numpy in one C call;
- the next model call's texts are tokenized on a helper thread while the GPU runs the current one
  (the backend releases the GIL; CUDA kernels run asynchronously);
- embeddings stay on the GPU until the batch is done: one copy back, one wait.

The shortcut is taken only where it is provably the same input: at load, :func:`fast_features`
tokenizes a sample both ways and any difference (keys, ids, masks, a prompt, a flattening or a
multimodal first module) keeps the library's ``encode``. Texts are length-sorted and cut into calls
exactly as ``encode`` cuts them, so on CPU the embeddings are bit-for-bit ``encode``'s (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

Features = dict[str, Any]
Tokenize = Callable[[list[str]], Features]

# what the load-time check tokenizes both ways: empty, short, accented, CJK, punctuation-heavy, and
# longer than any model's limit (truncation)
CHECK_TEXTS = [
    "",
    "ok",
    "Hello world.",
    "Ünïcödé àccents, émojis 🙂 and «quotes»",
    "日本語のテキストと English mixed",
    "a,b;c:d!e?f (g) [h] {i} 'j' \"k\" -- l",
    " ".join(["longer"] * 600),
]


def fast_features(model: Any, check: list[str] | None = None) -> Tokenize | None:
    """A tokenize function that returns exactly what ``model.preprocess`` returns for plain text,
    without transformers' per-token conversion; None where that cannot be shown on ``check``."""
    tokenizer = getattr(model, "tokenizer", None)
    if type(model[0]).__name__ != "Transformer" or not getattr(tokenizer, "is_fast", False):
        return None
    if getattr(model, "default_prompt_name", None) or getattr(model, "truncate_dim", None):
        return None
    if getattr(model[0], "can_flatten_inputs", False):  # encode then interleaves lengths and drops padding
        return None
    texts = check or CHECK_TEXTS
    try:
        tokenize = _backend_tokenize(model, tokenizer)
        reference = model.preprocess(texts)
        ours = tokenize(texts)
    except Exception:  # an unusual tokenizer (no pad token, a backend that will not copy): the library's own path then
        return None
    return tokenize if _same_features(reference, ours) else None


def _backend_tokenize(model: Any, tokenizer: Any) -> Tokenize:
    import torch
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # a copy: the model's own stays as it is
    backend.enable_truncation(
        max_length=int(model.max_seq_length or tokenizer.model_max_length),
        strategy="longest_first",
        direction=tokenizer.truncation_side,
    )
    backend.enable_padding(
        direction=tokenizer.padding_side,
        pad_id=tokenizer.pad_token_id,
        pad_type_id=tokenizer.pad_token_type_id,
        pad_token=tokenizer.pad_token,
    )
    names = [n for n in tokenizer.model_input_names if n in ("input_ids", "token_type_ids", "attention_mask")]
    extras = {k: v for k, v in model.preprocess(["ok"]).items() if not isinstance(v, torch.Tensor)}
    fields = {"input_ids": "ids", "token_type_ids": "type_ids", "attention_mask": "attention_mask"}

    def tokenize(texts: list[str]) -> Features:
        encodings = backend.encode_batch(texts, add_special_tokens=True)
        out: Features = {
            name: torch.from_numpy(np.array([getattr(e, fields[name]) for e in encodings], dtype=np.int64))
            for name in names
        }
        out.update(extras)  # constants the model's forward reads ('modality': 'text')
        return out

    return tokenize


def _same_features(reference: Features, ours: Features) -> bool:
    import torch

    if set(reference) != set(ours):
        return False
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            if not isinstance(ours[key], torch.Tensor) or not torch.equal(value, ours[key]):
                return False
        elif value != ours[key]:
            return False
    return True


def overlapped_encode(
    model: Any, texts: list[str], tokenize: Tokenize, batch_size: int, normalize: bool, device: str
) -> np.ndarray:
    """``model.encode(texts, batch_size=..., normalize_embeddings=...)`` as float32 numpy, with the
    next call's tokenizing overlapped with the current call's model run (module docstring)."""
    import torch

    if not texts:
        dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return np.zeros((0, dimension() or 0), dtype=np.float32)
    model.eval()  # as encode does on every call: no dropout, whatever mode the model was left in
    order = np.argsort([-len(t) for t in texts])  # encode's own order (BaseModel._input_length of a str)
    ordered = [texts[i] for i in order]
    calls = [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]
    outputs = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchinfer-tokenize") as pool:
        pending = pool.submit(tokenize, calls[0])
        for n in range(len(calls)):
            features = pending.result()
            if n + 1 < len(calls):
                pending = pool.submit(tokenize, calls[n + 1])
            features = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in features.items()}
            with torch.inference_mode():
                embeddings = model(features)["sentence_embedding"]
                if normalize:
                    embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
            outputs.append(embeddings)
    with torch.inference_mode():
        stacked = torch.cat(outputs).float().cpu().numpy()  # the one wait for the GPU
    result = np.empty_like(stacked)
    result[order] = stacked
    return result
