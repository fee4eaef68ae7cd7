"""The transformers_pipeline flavor: every supported task against the pipeline's (or the model's)
own output on the same rows, log-time refusals, bad inputs that fail before any compute, and one
``dag.test()`` run that scores text and transcribes audio files read through ``column_handling``.

Models are tiny, randomly initialised and built in-process (``tests/hf_support.py``); nothing is
downloaded. One module-scoped set-up logs them all into one embedded registry.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract.specs import InputSpec
from airflow_provider_batchinfer.registry import ModelRegistry, RegistryError, TamperedModelError
from airflow_provider_batchinfer.store.inputs import InputError
from airflow_provider_batchinfer.store.locations import sanitize_run_key
from tests import hf_support as hf
from tests.models import committed_manifest

# float32 scores from padded batches of 16 against the pipeline's own batching: on two torch threads
# they differed by up to 1.2e-5; a wrong row or label is off by ~0.1
ATOL = 5e-5
CANDIDATES = ["sport", "money", "weather"]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """An embedded default (BATCHINFER_HOME) with every task's tiny model logged as ``<task>/v1``."""
    root = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHINFER_HOME", str(root / "home"))
        dirs = {
            "text-classification": hf.build_text_classifier(root / "tc"),
            "zero-shot-classification": hf.build_text_classifier(root / "nli", labels=hf.NLI_LABELS),
            "token-classification": hf.build_token_classifier(root / "ner"),
            "feature-extraction": hf.build_feature_extractor(root / "fe"),
            "summarization": hf.build_seq2seq(root / "s2s"),
            "automatic-speech-recognition": hf.build_speech_recognizer(root / "asr"),
        }
        registry = ModelRegistry(str(root / "home" / "registry"))
        signatures = {"text-classification": {"outputs": {"label": "string", "score": "float32", "top_k": hf_top_k()}}}
        for task, path in dirs.items():
            registry.log_model(
                task.replace("-", "_"),
                "v1",
                "transformers_pipeline",
                str(path),
                task=task,
                signature=signatures.get(task),
            )
        yield {"root": root, "home": root / "home", "registry": registry, "dirs": dirs}


def hf_top_k() -> str:
    return "list<struct<label:string,score:float32>>"


def _predictor(registry: ModelRegistry, name: str, max_rows: int = 16):
    from airflow_provider_batchinfer.runtime.model.flavors import load_predictor

    model_dir = registry.local_copy(name, "v1")
    return load_predictor(model_dir, json.loads((model_dir / "MODEL.json").read_text()), "cpu", 1, max_rows)


def _pipe(path: Path, task: str):
    from transformers import pipeline

    return pipeline(task, model=str(path), device="cpu")


# --- every task, in process: the flavor's columns == the pipeline's own output -------------------------


def test_classification_tasks_match_the_pipelines_own_output(hf_home):
    registry, dirs, texts = hf_home["registry"], hf_home["dirs"], hf.texts(60)
    table = pa.table({"text": texts})

    out = _predictor(registry, "text_classification")(table, {})
    ref = _pipe(dirs["text-classification"], "text-classification")(texts, top_k=None)
    assert registry.get("text_classification", "v1").signature["outputs"] == {
        "label": "string",
        "score": "float32",
        "top_k": hf_top_k(),
    }
    assert out["label"].type == pa.string() and out["score"].type == pa.float32()
    assert out["label"].to_pylist() == [r[0]["label"] for r in ref]
    assert len(set(out["label"].to_pylist())) > 1  # a random model that labels every row alike tests nothing
    np.testing.assert_allclose(out["score"].to_numpy(), [r[0]["score"] for r in ref], atol=ATOL)
    got_top = out["top_k"].to_pylist()
    assert [[d["label"] for d in row] for row in got_top] == [[d["label"] for d in row] for row in ref]
    np.testing.assert_allclose(
        [[d["score"] for d in r] for r in got_top], [[d["score"] for d in r] for r in ref], atol=ATOL
    )

    out = _predictor(registry, "zero_shot_classification")(table, {"candidate_labels": CANDIDATES})
    ref = _pipe(dirs["zero-shot-classification"], "zero-shot-classification")(texts, candidate_labels=CANDIDATES)
    assert out["labels"].to_pylist() == [r["labels"] for r in ref]
    assert out["label"].to_pylist() == [r["labels"][0] for r in ref]
    np.testing.assert_allclose(
        np.stack(out["scores"].to_numpy(zero_copy_only=False)), [r["scores"] for r in ref], atol=ATOL
    )
    with pytest.raises(ValueError, match=r"needs its labels: InputSpec\(params=\{'candidate_labels'"):
        _predictor(registry, "zero_shot_classification")(table, {})

    out = _predictor(registry, "token_classification")(table, {})
    ref = _pipe(dirs["token-classification"], "token-classification")(texts, aggregation_strategy="simple")
    got = out["entities"].to_pylist()
    assert out["entities"].type.value_type.names == ["entity", "score", "word", "start", "end"]
    assert [[(e["entity"], e["word"], e["start"], e["end"]) for e in row] for row in got] == [
        [(e["entity_group"], e["word"], e["start"], e["end"]) for e in row] for row in ref
    ]
    assert sum(len(row) for row in got) > len(texts) / 2
    flat = [e["score"] for row in got for e in row]
    np.testing.assert_allclose(flat, [float(e["score"]) for row in ref for e in row], atol=ATOL)


def test_feature_extraction_and_summarization_match_the_models_own_output(hf_home):
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    registry, dirs, texts = hf_home["registry"], hf_home["dirs"], hf.texts(40, seed=3)
    table = pa.table({"text": texts})
    out = _predictor(registry, "feature_extraction")(table, {})
    pipe = _pipe(dirs["feature-extraction"], "feature-extraction")
    assert out["embedding"].type == pa.list_(pa.list_(pa.float32()))
    for got, text in zip(out["embedding"].to_pylist(), texts, strict=True):
        (ref,) = pipe(text)  # one text per call: no padding in the reference
        assert len(got) == len(ref)
        np.testing.assert_allclose(got, ref, atol=ATOL, rtol=ATOL)  # padding reorders sums: ~1e-5 relative

    long_text = " ".join(hf.WORDS * 8)  # 300+ tokens, beyond the models' 128 positions: truncated, not failed
    (vectors,) = _predictor(registry, "feature_extraction")(pa.table({"text": [long_text]}), {})[
        "embedding"
    ].to_pylist()
    assert len(vectors) == 128
    assert _predictor(registry, "text_classification")(pa.table({"text": [long_text]}), {})["label"].to_pylist()[0]

    out = _predictor(registry, "summarization")(table, {"max_new_tokens": 6})
    tok = AutoTokenizer.from_pretrained(str(dirs["summarization"]))
    model = AutoModelForSeq2SeqLM.from_pretrained(str(dirs["summarization"])).eval()
    expected = []
    with torch.inference_mode():
        for text in texts:  # unbatched: the flavor's length-sorted batches must not change a summary
            enc = tok([text], return_tensors="pt", return_token_type_ids=False)
            expected.append(tok.decode(model.generate(**enc, max_new_tokens=6)[0], skip_special_tokens=True).strip())
    assert out["summary_text"].to_pylist() == expected
    assert len(set(expected)) > 1


def test_speech_recognition_reads_wav_bytes_and_matches_the_pipeline(hf_home):
    registry, dirs = hf_home["registry"], hf_home["dirs"]
    clips = [hf.wav_bytes(0.2 + 0.05 * i, 200 + 40 * i) for i in range(10)]
    clips.append(hf.wav_bytes(0.3, 300, rate=8000))  # another rate: resampled to the model's 16 kHz
    predict = _predictor(registry, "automatic_speech_recognition", max_rows=4)
    out = predict(pa.table({"audio": pa.array(clips, pa.binary())}), {})
    from airflow_provider_batchinfer.runtime.model.flavors.transformers_pipeline import decode_wav

    pipe = _pipe(dirs["automatic-speech-recognition"], "automatic-speech-recognition")
    expected = [pipe(decode_wav(c, "audio", 16000))["text"] for c in clips]
    assert out["text"].to_pylist() == expected and len(set(expected)) > 1
    with pytest.raises(ValueError, match=r"column 'audio': 9 bytes that are not a PCM WAV file"):
        predict(pa.table({"audio": pa.array([b"not a wav"], pa.binary())}), {})
    with pytest.raises(ValueError, match=r"column 'audio': expected the bytes of a WAV file, got str.*column_handling"):
        predict(pa.table({"audio": ["/stage/a.wav"]}), {})


# --- log time: what is refused, with what to do ------------------------------------------------------


def test_log_time_refusals_say_what_to_do(hf_home, tmp_path):
    from transformers import pipeline

    registry, dirs = hf_home["registry"], hf_home["dirs"]
    tc = dirs["text-classification"]
    # a pipeline object carries its task; the signature follows from it
    mv = registry.log_model("from_pipe", "v1", "transformers_pipeline", pipeline("text-classification", model=str(tc)))
    manifest = registry.read_manifest("from_pipe", "v1")
    assert manifest["options"] == {"dir": "artifact", "task": "text-classification"}
    assert mv.signature == {"inputs": {"text": "string"}, "outputs": {"label": "string", "score": "float32"}}
    with pytest.raises(RegistryError, match=r"directory needs task=<one of \["):
        registry.log_model("m", "v1", "transformers_pipeline", str(tc))
    with pytest.raises(RegistryError, match=r"task 'image-to-text' is not supported .* supported tasks: automatic"):
        registry.log_model("m", "v1", "transformers_pipeline", str(tc), task="image-to-text")
    with pytest.raises(RegistryError, match=r"must be an NLI model with an 'entailment' label .*'negative'"):
        registry.log_model("m", "v1", "transformers_pipeline", str(tc), task="zero-shot-classification")
    with pytest.raises(RegistryError, match=r"produces .*; the signature asks for \{\"labels\": \"list<string>\"\}"):
        registry.log_model(
            "m",
            "v1",
            "transformers_pipeline",
            str(tc),
            task="sentiment-analysis",
            signature={"outputs": {"labels": "list<string>"}},
        )
    with pytest.raises(RegistryError, match=r"reads one input column of dtype 'string'"):
        registry.log_model(
            "m", "v1", "transformers_pipeline", str(tc), task="ner", signature={"inputs": {"text": "int64"}}
        )
    with pytest.raises(RegistryError, match=r"unexpected options \['task'\] for flavor 'python'"):
        registry.log_model("m", "v1", "python", python_class="x:Y", task="ner")
    pickled = tmp_path / "pickled"
    shutil.copytree(tc, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(RegistryError, match=r"no .safetensors weights \(\['pytorch_model.bin'\]\): pickled"):
        registry.log_model("m", "v1", "transformers_pipeline", str(pickled), task="text-classification")
    remote = tmp_path / "remote"
    shutil.copytree(tc, remote)
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "m.M"}}))
    with pytest.raises(RegistryError, match=r"custom modelling code \(config.json auto_map\)"):
        registry.log_model("m", "v1", "transformers_pipeline", str(remote), task="text-classification")
    assert registry.list_versions("m") == []  # nothing half-logged


# --- bad inputs: refused by the runtime before Ray starts, nothing committed ----------------------------


@pytest.fixture
def fails_before_ray(monkeypatch, hf_home, tmp_path):
    def check(model: str, table: pa.Table, match: str, error=(InputError,), input_spec=None):
        hf.assert_fails_before_ray(monkeypatch, tmp_path, hf_home["registry"], model, table, match, error, input_spec)

    return check


def test_bad_inputs_fail_before_any_compute_naming_the_column(fails_before_ray, hf_home):
    fails_before_ray(
        "text_classification",
        pa.table({"id": [1, 2], "body": ["a", "b"]}),
        r"model input 'text' needs column 'text', which the input .* does not have \(columns: \['id', 'body'\]\)",
    )
    fails_before_ray(
        "text_classification",
        pa.table({"id": [1, 2], "text": [1.5, 2.5]}),
        r"column 'text' of .* is double, but model input 'text' expects string",
    )
    fails_before_ray(
        "automatic_speech_recognition",
        pa.table({"id": [1], "path": ["/x.wav"]}),
        r"InputSpec.column_handling names \['clip'\], which the model does not read",
        input_spec=InputSpec(id_column="id", column_mapping={"path": "audio"}, column_handling={"clip": "bytes"}),
    )


def test_a_model_file_changed_after_logging_is_refused_before_any_compute(fails_before_ray, hf_home):
    registry = hf_home["registry"]
    registry.log_model(
        "tampered",
        "v1",
        "transformers_pipeline",
        str(hf_home["dirs"]["text-classification"]),
        task="text-classification",
    )
    config = Path(registry.get("tampered", "v1").uri) / "artifact" / "config.json"
    config.write_text(config.read_text().replace('"positive"', '"POSITIVE"'))
    fails_before_ray(
        "tampered",
        pa.table({"id": [1], "text": ["a"]}),
        r"artifact/config.json does not match its recorded sha256",
        error=(TamperedModelError,),
    )


# --- end to end through dag.test(): text and audio files ----------------------------------------------


@pytest.mark.usefixtures("airflow_db")
def test_dag_scores_text_and_transcribes_audio_files(hf_home, monkeypatch):
    """600 texts through text-classification and 24 WAV files (read from the stage through
    ``column_handling``) through speech recognition, in one DAG; every prediction equals the
    pipeline's own on the same rows."""
    from tests.conftest import run_dag

    monkeypatch.setenv("BATCHINFER_HOME", str(hf_home["home"]))
    home, dirs = hf_home["home"], hf_home["dirs"]
    n = 600
    texts = hf.texts(n, seed=11)
    (home / "in-text").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": pa.array(range(n), pa.int64()), "text": texts}), home / "in-text" / "t.parquet")
    audio_dir = home / "stage" / "audio"
    audio_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(24):
        path = audio_dir / f"clip-{i:02d}.wav"
        path.write_bytes(hf.wav_bytes(0.2 + 0.02 * i, 150 + 30 * i))
        paths.append(str(path))
    (home / "in-audio").mkdir(exist_ok=True)
    pq.write_table(pa.table({"id": list(range(24)), "path": paths}), home / "in-audio" / "a.parquet")

    state, tasks, run_id = run_dag(
        "bi_test_hf_pipelines", text_input=str(home / "in-text"), audio_input=str(home / "in-audio")
    )
    assert state == "success", tasks
    run_key = sanitize_run_key(run_id)

    manifest = committed_manifest(str(home / "stage" / "labels" / run_key))
    assert manifest["counts"] == {"input_rows": n, "output_rows": n, "error_rows": 0}
    assert manifest["model"]["name"] == "text_classification"
    out = pq.read_table([f"{manifest['run_dir']}/{f['name']}" for f in manifest["files"]]).sort_by("id")
    assert out.schema.field("label").type == pa.string() and out.schema.field("score").type == pa.float32()
    assert out.schema.field("top_k").type == pa.list_(pa.struct([("label", pa.string()), ("score", pa.float32())]))
    ref = _pipe(dirs["text-classification"], "text-classification")(texts, batch_size=64, top_k=None)
    assert out.column("id").to_pylist() == list(range(n))
    assert out.column("label").to_pylist() == [r[0]["label"] for r in ref]
    np.testing.assert_allclose(out.column("score").to_numpy(), [r[0]["score"] for r in ref], atol=ATOL)

    manifest = committed_manifest(str(home / "stage" / "transcripts" / run_key))
    assert manifest["counts"] == {"input_rows": 24, "output_rows": 24, "error_rows": 0}
    out = pq.read_table([f"{manifest['run_dir']}/{f['name']}" for f in manifest["files"]]).sort_by("id")
    assert out.column_names == ["id", "text"]
    from airflow_provider_batchinfer.runtime.model.flavors.transformers_pipeline import decode_wav

    pipe = _pipe(dirs["automatic-speech-recognition"], "automatic-speech-recognition")
    expected = [pipe(decode_wav(Path(p).read_bytes(), "audio", 16000))["text"] for p in paths]
    assert out.column("text").to_pylist() == expected
