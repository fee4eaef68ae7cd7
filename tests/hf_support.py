"""Tiny, randomly initialised transformers models with in-process tokenizers (nothing downloaded),
and the inputs the transformers_pipeline and MLflow tests score.

Each builder writes a ``save_pretrained`` directory: model + tokenizer (or feature extractor) for
one pipeline task. Weights are drawn with a large ``initializer_range`` so a random model's
predictions differ from row to row (with the default 0.02 every row gets the same label, and a
test that compares labels could not fail).
"""

from __future__ import annotations

import io
import math
import shutil
import wave
from pathlib import Path

WORDS = [
    "the",
    "a",
    "an",
    "export",
    "is",
    "slow",
    "login",
    "fails",
    "billing",
    "page",
    "great",
    "awesome",
    "terrible",
    "bad",
    "good",
    "love",
    "hate",
    "ticket",
    "team",
    "help",
    "alice",
    "bob",
    "paris",
    "acme",
    "works",
    "at",
    "in",
    "from",
    "to",
    "invoice",
    "refund",
    "urgent",
    "please",
    "dashboard",
    "mobile",
    "app",
    "update",
    "summary",
    "translate",
    "weather",
    "sport",
    "politics",
    "money",
]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NLI_LABELS = {0: "contradiction", 1: "neutral", 2: "entailment"}
NER_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-ORG", 4: "I-ORG", 5: "B-LOC", 6: "I-LOC"}
ASR_VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "|", *"abcdefghijklmnopqrstuvwxyz'"]
SAMPLING_RATE = 16000


def texts(rows: int, seed: int = 0) -> list[str]:
    """Varied sentences (1-14 words, some unknown words), so batches really pad."""
    import random

    rng = random.Random(seed)
    extra = ["zzz", "qqq42", "Acme", "PARIS"]
    return [" ".join(rng.choice(WORDS + extra) for _ in range(1 + (i * 7) % 14)) for i in range(rows)]


def bert_tokenizer():
    from transformers import BertTokenizer

    return BertTokenizer(vocab={w: i for i, w in enumerate([*SPECIALS, *WORDS])}, model_max_length=128)


def _bert_config(tokenizer, **kwargs):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=0.5,
        **kwargs,
    )


def _save(path: Path, model, *parts) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(str(path))
    for part in parts:
        part.save_pretrained(str(path))
    return path


def build_text_classifier(path: str | Path, labels: dict[int, str] | None = None, seed: int = 0) -> Path:
    """A 2-layer BERT sequence classifier (sentiment labels; NLI labels for zero-shot)."""
    import torch
    from transformers import BertForSequenceClassification

    labels = labels or {0: "negative", 1: "neutral", 2: "positive"}
    tok = bert_tokenizer()
    torch.manual_seed(seed)
    model = BertForSequenceClassification(
        _bert_config(tok, num_labels=len(labels), id2label=labels, label2id={v: k for k, v in labels.items()})
    )
    return _save(Path(path), model, tok)


def build_token_classifier(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import BertForTokenClassification

    tok = bert_tokenizer()
    torch.manual_seed(seed)
    model = BertForTokenClassification(
        _bert_config(
            tok, num_labels=len(NER_LABELS), id2label=NER_LABELS, label2id={v: k for k, v in NER_LABELS.items()}
        )
    )
    return _save(Path(path), model, tok)


def build_feature_extractor(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import BertModel

    tok = bert_tokenizer()
    torch.manual_seed(seed)
    return _save(Path(path), BertModel(_bert_config(tok)), tok)


def build_seq2seq(path: str | Path, seed: int = 0) -> Path:
    """A 1-layer T5 with the word-level BERT vocabulary ([PAD] = pad = decoder start, [SEP] = EOS)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    tok = bert_tokenizer()
    tok.eos_token = "[SEP]"
    config = T5Config(
        vocab_size=len(tok),
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.sep_token_id,
        decoder_start_token_id=tok.pad_token_id,
        initializer_factor=4.0,
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config)
    model.generation_config.max_new_tokens = 12
    model.generation_config.eos_token_id = tok.sep_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.decoder_start_token_id = tok.pad_token_id
    return _save(Path(path), model, tok)


def build_speech_recognizer(path: str | Path, seed: int = 0) -> Path:
    """A tiny wav2vec2 CTC model with a character vocabulary and its feature extractor."""
    import json
    import tempfile

    import torch
    from transformers import (
        Wav2Vec2Config,
        Wav2Vec2CTCTokenizer,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2ForCTC,
        Wav2Vec2Processor,
    )

    with tempfile.TemporaryDirectory() as tmp:
        vocab_file = Path(tmp) / "vocab.json"
        vocab_file.write_text(json.dumps({c: i for i, c in enumerate(ASR_VOCAB)}))
        tok = Wav2Vec2CTCTokenizer(str(vocab_file), unk_token="<unk>", pad_token="<pad>", word_delimiter_token="|")
    extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=SAMPLING_RATE, padding_value=0.0, do_normalize=True, return_attention_mask=True
    )
    config = Wav2Vec2Config(
        vocab_size=len(ASR_VOCAB),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        pad_token_id=0,
        ctc_loss_reduction="mean",
        initializer_range=0.5,
    )
    torch.manual_seed(seed)
    model = Wav2Vec2ForCTC(config)
    return _save(Path(path), model, Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tok))


def wav_bytes(seconds: float, freq: float, rate: int = SAMPLING_RATE) -> bytes:
    """A 16-bit mono PCM WAV file holding a tone with a little noise."""
    import numpy as np

    n = int(seconds * rate)
    t = np.arange(n) / rate
    rng = np.random.default_rng(int(freq))
    signal = 0.5 * np.sin(2 * math.pi * freq * t) + 0.05 * rng.standard_normal(n)
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def assert_fails_before_ray(
    monkeypatch, tmp_path: Path, registry, model: str, table, match: str, error, input_spec=None
):
    """Drive the runtime's entrypoint on ``table`` for ``model``/v1 with ``ray.init`` made to fail:
    it must raise ``error`` matching ``match`` before any compute and leave only ``_job.json``."""
    import pyarrow.parquet as pq
    import pytest
    import ray

    from airflow_provider_batchinfer.contract.specs import InputSpec
    from airflow_provider_batchinfer.runtime.driver import run
    from tests.models import job_file, write_job_file

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started, but this bad input must fail before any compute")

    monkeypatch.setattr(ray, "init", refuse)
    inputs = tmp_path / "in"
    inputs.mkdir(exist_ok=True)
    pq.write_table(table, inputs / "part.parquet")
    run_dir = tmp_path / "out"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir()
    spec = job_file(
        run_dir,
        registry.get(model, "v1"),
        registry.root,
        [inputs / "part.parquet"],
        input_spec=input_spec or InputSpec(id_column="id"),
    )
    with pytest.raises(error, match=match):
        run(write_job_file(spec))
    assert sorted(p.name for p in run_dir.iterdir() if p.name != "_claims") == ["_job.json"]  # no part, no marker
