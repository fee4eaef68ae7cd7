"""LLM and multimodal batch inference: chat messages in, OpenAI-shaped responses out, files read
from stages under allowed roots, vLLM through ``ray.data.llm``.

Models are built in-process (``demo_models``: a tiny Llama with a word-level tokenizer and a chat
template, a tiny ViT trained to tell red/green/blue apart); nothing is downloaded. The two example
DAGs run end to end once each through ``dag.test()``; every ``column_handling`` rule and the vLLM
mapping are checked on the pure functions, and the row-level file errors through the model replica
(the code each Ray actor runs) and one real Ray job.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import ERROR_PREFIX, SUCCESS_MARKER
from airflow_provider_batchinfer.contract.chat import response_columns, sampling_params, text_to_messages
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, SpecError
from airflow_provider_batchinfer.registry.demo_models import (
    build_tiny_chat_model,
    build_tiny_image_classifier,
    color_image,
)
from airflow_provider_batchinfer.runtime.model import dereference, llm
from airflow_provider_batchinfer.runtime.model.dereference import (
    FileReferenceError,
    check_location,
    dereference_inputs,
    dereference_messages,
    normalize_roots,
    read_location,
)
from airflow_provider_batchinfer.store.locations import sanitize_run_key
from airflow_provider_batchinfer.store.stage import Stage
from tests.models import committed_manifest, job_file, write_job_file


def run_runtime(spec_location: str, **env: str) -> tuple[int, str]:
    """The Ray-side entrypoint as the local launcher runs it: a subprocess (its own Ray driver)."""
    import subprocess
    import sys

    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **env}
    environ = {k: v for k, v in environ.items() if v is not None and v != ""}
    proc = subprocess.run(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", spec_location],
        capture_output=True,
        text=True,
        env=environ,
        timeout=900,
    )
    return proc.returncode, proc.stdout + proc.stderr


def png_bytes(color: str = "red", fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    color_image(color, seed=7).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def image_model_dir(tmp_path_factory) -> Path:
    return build_tiny_image_classifier(tmp_path_factory.mktemp("vit") / "model")


@pytest.fixture
def stage_root(tmp_path) -> Path:
    root = tmp_path / "stage"
    (root / "images").mkdir(parents=True)
    return root


# --- column_handling: every encoding, local and s3:// -------------------------------------------------


def test_every_encoding_of_column_handling_local_and_s3(stage_root, s3_server, s3_bucket):
    png, wav = png_bytes(), b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(40))
    (stage_root / "images" / "a.png").write_bytes(png)
    (stage_root / "clip").write_bytes(wav)  # no extension: the MIME type comes from the bytes
    s3_opts = {"endpoint_url": s3_server, "region": "us-east-1", "access_key": "AKIDTEST", "secret_key": "x"}
    Stage.open(f"s3://{s3_bucket}/stage/b.jpg", s3_opts).write_bytes(png_bytes("blue", "JPEG"))
    spec = InputSpec(
        column_handling={
            "raw": "bytes",
            "b64": "base64",
            "url": "data_url",
            "typed": {"encoding": "data_url", "mime_type": "audio/x-wav"},
        }
    )
    plan = dereference.dereference_plan(
        spec.column_handling,
        ["raw", "b64", "url", "typed"],
        [],
        {},
        [str(stage_root), f"s3://{s3_bucket}/stage"],
        s3_opts,
    )
    a, clip, b = str(stage_root / "images" / "a.png"), str(stage_root / "clip"), f"s3://{s3_bucket}/stage/b.jpg"
    table = pa.table({"raw": [a, b], "b64": [b, a], "url": [a, clip], "typed": [clip, f"file://{a}"]})
    out = dereference_inputs(table, plan)
    jpg = Stage.open(b, s3_opts).read_bytes()
    assert out.schema.field("raw").type == pa.binary() and out.column("raw").to_pylist() == [png, jpg]
    assert out.column("b64").to_pylist() == [base64.b64encode(jpg).decode(), base64.b64encode(png).decode()]
    assert out.column("url").to_pylist() == [
        f"data:image/png;base64,{base64.b64encode(png).decode()}",
        f"data:audio/wav;base64,{base64.b64encode(wav).decode()}",
    ]
    assert out.column("typed").to_pylist()[0] == f"data:audio/x-wav;base64,{base64.b64encode(wav).decode()}"
    assert out.column("typed").to_pylist()[1].startswith("data:audio/x-wav;base64,iVBORw0KGgo")
    roots = normalize_roots(plan["roots"])
    with pytest.raises(FileReferenceError, match=rf"file s3://{s3_bucket}/stage/gone.png does not exist"):
        read_location(f"s3://{s3_bucket}/stage/gone.png", roots, s3_opts, "raw")
    with pytest.raises(FileReferenceError, match=rf"cannot read {stage_root}/images: .*is a directory"):
        read_location(f"{stage_root}/images", roots, None, "raw")
    with pytest.raises(ValueError, match=r"column_handling names \['color'\], which the model does not read"):
        dereference.dereference_plan({"color": {"encoding": "bytes"}}, ["path"], ["image"], {}, [], None)
    with pytest.raises(SpecError, match=r"column_handling\['x'\]='hex': use one of \['bytes', 'base64', 'data_url'\]"):
        InputSpec(column_handling={"x": "hex"})
    with pytest.raises(SpecError, match=r"column_handling names \['img'\], which are not in InputSpec.columns"):
        InputSpec(columns=["id"], column_handling={"img": "bytes"})


def test_escaping_locations_fail_without_the_file_being_opened(stage_root, tmp_path, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    (stage_root / "images" / "link.png").symlink_to(secret)
    (stage_root / "images" / "ok.png").write_bytes(png_bytes())
    opened: list[str] = []
    real_read = dereference._read
    monkeypatch.setattr(dereference, "_read", lambda loc, so: opened.append(loc) or real_read(loc, so))
    roots = normalize_roots([str(stage_root), "s3://team-bucket/stage"])
    cases = {
        f"{stage_root}/images/../../secret.txt": "contains '..'",
        str(secret): "is outside the allowed roots",
        f"file://{secret}": "is outside the allowed roots",
        f"{stage_root}/images/link.png": f"resolves to {secret}) is outside the allowed roots",
        f"{stage_root}-other/x.png": "is outside the allowed roots",  # a sibling that shares the prefix
        "images/ok.png": "is a relative path",
        "s3://other-bucket/stage/x.png": "is outside the allowed roots",
        "s3://team-bucket/stage/../private/x.png": "contains '..'",
        "s3://team-bucket/stagefright/x.png": "is outside the allowed roots",
        "https://example.com/x.png": "only local paths and s3:// URIs can be read",
    }
    for location, message in cases.items():
        with pytest.raises(FileReferenceError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            read_location(location, roots, None, "image_path")
        assert "column 'image_path'" in str(info.value) and location in str(info.value)
    assert opened == []  # none of them reached the one function that opens files
    assert read_location(f"{stage_root}/images/ok.png", roots, None) == png_bytes()
    assert opened == [f"{stage_root}/images/ok.png"]
    assert check_location("s3://team-bucket/stage/a/b.png", roots) == "s3://team-bucket/stage/a/b.png"
    with pytest.raises(FileReferenceError, match=rf"file {stage_root}/images/gone.png does not exist"):
        read_location(f"{stage_root}/images/gone.png", roots, None, "image_path")


def test_stage_files_inside_chat_messages_are_inlined_and_checked(stage_root, monkeypatch):
    png = png_bytes()
    (stage_root / "images" / "p.png").write_bytes(png)
    (stage_root / "call.mp3").write_bytes(b"ID3\x03fake-mp3")
    roots = normalize_roots([str(stage_root)])
    messages = [
        {"role": "system", "content": "Describe products."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": str(stage_root / "images" / "p.png"), "detail": "low"}},
                {"type": "text", "text": "and this?"},  # http(s) URLs: tests/unit/test_reference_bounds.py
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "input_audio", "input_audio": {"data": str(stage_root / "call.mp3")}},
                {"type": "input_audio", "input_audio": {"data": "//uQxAAAAAAA", "format": "mp3"}},  # base64 data
            ],
        },
    ]
    out = dereference_messages(messages, roots, None)
    parts = out[1]["content"]
    assert out[0] == messages[0] and parts[0] == messages[1]["content"][0]
    assert parts[1]["image_url"] == {"url": f"data:image/png;base64,{base64.b64encode(png).decode()}", "detail": "low"}
    assert parts[2:4] == messages[1]["content"][2:4]
    assert parts[4]["input_audio"] == {"data": base64.b64encode(b"ID3\x03fake-mp3").decode(), "format": "mp3"}
    assert parts[5] == messages[1]["content"][5]
    opened: list[str] = []
    monkeypatch.setattr(dereference, "_read", lambda loc, so: opened.append(loc) or b"")
    evil = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd.png"}}]}]
    with pytest.raises(FileReferenceError, match=r"column 'messages': '/etc/passwd.png' is outside the allowed roots"):
        dereference_messages(evil, roots, None)
    assert opened == []


# --- chat helpers ------------------------------------------------------------------------------------


def test_prompt_template_helper_and_sampling_params():
    table = pa.table({"ticket_id": [7, 8], "text": ["Export fails.", "Login loops."]})
    out = text_to_messages(table, "Summarize ticket {ticket_id}: {text}", system="Be brief.")
    assert out.column("messages").to_pylist()[1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Summarize ticket 8: Login loops."},
    ]
    with pytest.raises(ValueError, match=r"prompt template names \['body'\], which are not columns"):
        text_to_messages(table, "{body}")
    sp = sampling_params({"temperature": 0.2, "max_tokens": 16, "stop": "\n"}, json.dumps({"max_tokens": 4, "seed": 3}))
    assert sp == {"temperature": 0.2, "top_p": 1.0, "max_tokens": 4, "stop": ["\n"], "seed": 3}
    assert sampling_params({}, {"temperature": None})["temperature"] == 1.0  # an Arrow struct's missing field
    with pytest.raises(ValueError, match=r"InputSpec.params has unknown sampling parameter\(s\) \['max_token'\]"):
        sampling_params({"max_token": 5})
    with pytest.raises(ValueError, match="max_tokens must be a whole number >= 1"):
        sampling_params({}, {"max_tokens": 0})


@pytest.mark.usefixtures("airflow_db")
def test_connection_sets_allowed_roots_and_llm_engine(tmp_path, monkeypatch):
    from airflow_provider_batchinfer.hooks.model_service import ModelServiceHook

    monkeypatch.setenv(
        "AIRFLOW_CONN_BI_LLM",
        json.dumps(
            {
                "conn_type": "batchinfer",
                "extra": {
                    "stage_root": str(tmp_path / "s"),
                    "allowed_roots": "s3://images/products/, /mnt/photos",
                    "llm_engine": "vllm",
                },
            }
        ),
    )
    cfg = ModelServiceHook("bi_llm").config
    assert cfg.file_roots == [str(tmp_path / "s"), "s3://images/products", "/mnt/photos"] and cfg.llm_engine == "vllm"
    for extra, message in (
        ({"allowed_roots": ["photos"]}, "allowed_roots entry 'photos' must be an absolute path"),
        ({"allowed_roots": ["/data/../etc"]}, "without '..'"),
        ({"llm_engine": "tgi"}, "llm_engine 'tgi' is not available"),
    ):
        monkeypatch.setenv("AIRFLOW_CONN_BI_BAD", json.dumps({"conn_type": "batchinfer", "extra": extra}))
        with pytest.raises(ValueError, match=message):
            ModelServiceHook("bi_bad").config


# --- the vLLM engine: everything but the GPU ----------------------------------------------------------


def test_engine_choice_and_early_failures_without_gpu_or_vllm(tmp_path):
    assert llm.resolve_engine("text_generation", JobSpec()) == "transformers"
    assert llm.resolve_engine("text_generation", JobSpec(num_gpus=1)) == "vllm"
    assert llm.resolve_engine("text_generation", JobSpec(), default_engine="vllm") == "vllm"  # the connection's
    assert llm.resolve_engine("text_generation", JobSpec(num_gpus=1, engine="transformers"), "vllm") == "transformers"
    assert llm.resolve_engine("image_classification", JobSpec(num_gpus=1)) is None
    with pytest.raises(llm.LLMEngineError, match="applies to text_generation models, not torchscript"):
        llm.resolve_engine("torchscript", JobSpec(engine="vllm"))
    with pytest.raises(llm.LLMEngineError, match=r"JobSpec.num_gpus is 0: set JobSpec\(num_gpus=1\)"):
        llm.check_vllm_job(JobSpec(engine="vllm"))
    with pytest.raises(llm.LLMEngineError, match=r"needs the vllm package.*airflow-provider-batchinfer\[llm\]"):
        llm.check_vllm_job(JobSpec(num_gpus=1), find_spec=lambda name: None)
    with pytest.raises(llm.LLMEngineError, match=r"needs 2 GPU\(s\) per replica .* has 1: no CUDA GPU"):
        llm.check_cluster(JobSpec(num_gpus=1, engine_kwargs={"tensor_parallel_size": 2}), {"CPU": 8, "GPU": 1})
    llm.check_cluster(JobSpec(num_gpus=2), {"GPU": 2})
    chat_model_dir, vision_model_dir = tmp_path / "chat", tmp_path / "vision"
    for path, config in ((chat_model_dir, {"model_type": "llama"}), (vision_model_dir, {"vision_config": {}})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    job = JobSpec(
        replicas=3, num_gpus=2, max_batch_rows=128, engine_kwargs={"max_model_len": 4096, "dtype": "bfloat16"}
    )
    assert llm.processor_config(vision_model_dir, job)["prepare_multimodal_stage"] is True
    config = llm.processor_config(chat_model_dir, job)
    assert config == {
        "model_source": str(chat_model_dir),
        "concurrency": 3,
        "batch_size": 128,
        "engine_kwargs": {"max_model_len": 4096, "dtype": "bfloat16", "tensor_parallel_size": 2},
        "chat_template_stage": True,
        "tokenize_stage": True,
        "detokenize_stage": True,
        "prepare_multimodal_stage": False,
    }
    from ray.data.llm import vLLMEngineProcessorConfig

    parsed = vLLMEngineProcessorConfig(**config)  # ray 2.60's own validation accepts the mapping
    assert parsed.engine_kwargs["tensor_parallel_size"] == 2 and parsed.concurrency == 3


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_job_without_vllm_fails_before_ray_starts_and_commits_nothing(registry, chat_model_dir, tmp_path):
    mv = registry.log_model("chat", "v1", "text_generation", str(chat_model_dir))
    (tmp_path / "input").mkdir()
    table = text_to_messages(pa.table({"ticket_id": [1, 2], "text": ["export fails", "login loops"]}), "{text}")
    pq.write_table(table.select(["ticket_id", "messages"]), tmp_path / "input" / "t.parquet")
    run_dir = Stage.open(str(tmp_path / "out"))
    spec = job_file(
        run_dir.location,
        mv,
        registry.root,
        [tmp_path / "input"],
        job_id="t-vllm",
        attempt="t01v",
        job_spec=JobSpec(num_gpus=1),
        file_roots=[tmp_path],
        ray_address="127.0.0.1:1",
    )  # never reached: fails before Ray
    rc, output = run_runtime(write_job_file(spec))
    (error_line,) = [line for line in output.splitlines() if line.startswith(ERROR_PREFIX)]
    error = json.loads(error_line[len(ERROR_PREFIX) :])
    assert rc != 0 and error["type"] == "LLMEngineError"
    assert error["error"].startswith("LLMEngineError: the vLLM engine needs the vllm package, which is not installed")
    assert "[llm]" in error["error"] and "JobSpec(engine='transformers')" in error["error"]
    assert sorted(name for name, _ in run_dir.list_files()) == ["_job.json"]


def test_vllm_pre_and_postprocess_map_rows_to_the_response_columns(stage_root):
    (stage_root / "images" / "p.png").write_bytes(png_bytes())
    plan = dereference.dereference_plan(
        {}, ["messages"], ["messages"], {"messages": "messages"}, [str(stage_root)], None
    )
    pre = llm.Preprocess("messages", ["ticket_id"], {"temperature": 0, "max_tokens": 8}, plan)
    row = {
        "ticket_id": 5,
        "sampling_params": {"seed": 11, "temperature": None},
        "messages": json.dumps(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "label it"},
                        {"type": "image_url", "image_url": {"url": str(stage_root / "images" / "p.png")}},
                    ],
                }
            ]
        ),
    }
    out = pre(row)
    assert out["ticket_id"] == 5
    assert out["sampling_params"] == {
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 8,
        "detokenize": False,
        "seed": 11,
    }
    assert out["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,iVBOR")
    post = llm.Postprocess(["ticket_id"])
    # the columns ray.data.llm's vLLM stage adds (vLLMOutputData) after detokenize
    engine_rows = [
        {
            **out,
            "prompt": "user : label it",
            "num_input_tokens": 9,
            "generated_text": " a red mug ",
            "num_generated_tokens": 4,
        },
        {**out, "ticket_id": 6, "num_input_tokens": 3, "generated_text": "x " * 8, "num_generated_tokens": 8},
    ]
    rows = [post(r) for r in engine_rows]
    table = llm.to_response_table(pa.Table.from_pylist(rows), ["ticket_id"])
    assert table.column_names == ["ticket_id", "choices", "usage"]
    from airflow_provider_batchinfer.contract.chat import response_types

    assert (table.schema.field("choices").type, table.schema.field("usage").type) == response_types()
    expected = response_columns(
        [
            {
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "a red mug"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
            },
            {
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": ("x " * 8).strip()},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11},
            },
        ]
    )
    assert table.column("choices").combine_chunks().equals(expected["choices"])
    assert table.column("usage").combine_chunks().equals(expected["usage"])


# --- the CPU engines through the model replica (the code each Ray actor runs) -------------------------


def test_transformers_engine_honours_row_overrides_stop_strings_and_seeds(registry, chat_model_dir):
    from airflow_provider_batchinfer.runtime.model.flavors import load_predictor

    mv = registry.log_model("chat", "v1", "text_generation", str(chat_model_dir))
    model_dir = registry.local_copy("chat", "v1")
    predict = load_predictor(model_dir, json.loads((model_dir / "MODEL.json").read_text()), "cpu", 1)
    assert mv.signature["inputs"] == {"messages": "messages", "sampling_params": "optional"}
    base = text_to_messages(pa.table({"text": ["the billing page fails", "login is slow"]}), "summarize : {text}")
    greedy = predict(base.select(["messages"]), {"temperature": 0, "max_tokens": 12})
    full = greedy["choices"].to_pylist()[0][0]["message"]["content"]
    words = full.split()
    k = next(i for i in range(2, len(words)) if f" {words[i]}" not in f" {' '.join(words[:i])}" and words[i] != ":")
    overrides = pa.array([json.dumps({"stop": f" {words[k]}"}), json.dumps({"max_tokens": 3})])
    out = predict(
        base.select(["messages"]).append_column("sampling_params", overrides), {"temperature": 0, "max_tokens": 12}
    )
    (stopped,), (short,) = out["choices"].to_pylist()
    assert stopped["message"]["content"] == " ".join(words[:k]) and stopped["finish_reason"] == "stop"
    assert out["usage"].to_pylist()[0]["completion_tokens"] == k + 1  # the stop word was generated, then cut
    assert short["finish_reason"] == "length" and out["usage"].to_pylist()[1]["completion_tokens"] == 3
    assert short["message"]["content"] == " ".join(
        greedy["choices"].to_pylist()[1][0]["message"]["content"].split()[:3]
    )
    sampled = [
        predict(base.select(["messages"]), {"temperature": 1.0, "max_tokens": 12, "seed": seed})["choices"]
        for seed in (5, 5, 6)
    ]
    assert sampled[0].equals(sampled[1]) and not sampled[0].equals(sampled[2])
    image = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                ],
            }
        ]
    ]
    with pytest.raises(ValueError, match=r"model chat/v1 reads text only, but a message has \['image_url'\] parts"):
        predict(pa.table({"messages": [json.dumps(m) for m in image]}), {})


def test_model_replica_reads_files_and_fails_a_row_with_its_path(
    registry, image_model_dir, stage_root, tmp_path, monkeypatch
):
    from airflow_provider_batchinfer.runtime.model.replica import ModelReplica
    from airflow_provider_batchinfer.runtime.planning.pipeline import plan_columns

    mv = registry.log_model("labeler", "v1", "image_classification", str(image_model_dir))
    spec = InputSpec(column_mapping={"path": "image"}, column_handling={"path": "bytes"})
    paths = []
    for i, (color, fmt) in enumerate([("red", "PNG"), ("green", "JPEG"), ("blue", "PNG")]):
        path = stage_root / "images" / f"{i}.{fmt.lower()}"
        path.write_bytes(png_bytes(color, fmt))
        paths.append(str(path))
    batch = pa.table({"id": [0, 1, 2], "path": paths})
    plan = plan_columns(batch.schema, mv.signature, spec, "in.parquet")
    plan["dereference"] = dereference.dereference_plan(
        spec.column_handling, plan["sources"], plan["model_inputs"], mv.signature["inputs"], [str(stage_root)], None
    )
    replica = ModelReplica(str(registry.local_copy("labeler", "v1")), mv.sha256, plan, {}, "cpu", 1)
    out = replica(batch)
    assert out.column("id").to_pylist() == [0, 1, 2] and out.column("label").to_pylist() == ["red", "green", "blue"]
    secret = tmp_path / "secret.png"
    secret.write_bytes(png_bytes())
    opened: list[str] = []
    real_read = dereference._read
    monkeypatch.setattr(dereference, "_read", lambda loc, so: opened.append(loc) or real_read(loc, so))
    with pytest.raises(FileReferenceError, match=rf"column 'image': '{secret}' is outside the allowed roots"):
        replica(pa.table({"id": [3, 4], "path": [paths[0], str(secret)]}))
    assert str(secret) not in opened


@pytest.mark.usefixtures("ray_cluster")
def test_ray_job_with_a_missing_image_fails_naming_it_and_commits_nothing(
    registry, image_model_dir, stage_root, tmp_path
):
    mv = registry.log_model("labeler", "v1", "image_classification", str(image_model_dir))
    good = stage_root / "images" / "ok.png"
    good.write_bytes(png_bytes())
    missing = stage_root / "images" / "never-written.png"
    inputs = tmp_path / "input"
    inputs.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "path": [str(good), str(missing)]}), inputs / "products.parquet")
    run_dir = Stage.open(str(tmp_path / "out" / "run1"))
    spec = job_file(
        run_dir.location,
        mv,
        registry.root,
        [inputs],
        job_id="t-missing",
        attempt="t01abc",
        input_spec=InputSpec(column_mapping={"path": "image"}, column_handling={"path": "bytes"}),
        job_spec=JobSpec(max_batch_rows=8, progress_interval_s=1),
        file_roots=[stage_root],
    )
    rc, output = run_runtime(write_job_file(spec))
    (error_line,) = [line for line in output.splitlines() if line.startswith(ERROR_PREFIX)]
    assert rc != 0 and json.loads(error_line[len(ERROR_PREFIX) :])["error"] == (
        f"FileReferenceError: column 'image': file {missing} does not exist; fix the location in data_prep"
    )
    assert not run_dir.child(SUCCESS_MARKER).exists()


# --- the example DAGs end to end -------------------------------------------------------------------------


@pytest.mark.usefixtures("airflow_db")
def test_ticket_summaries_dag_fills_responses_and_token_counts_reconcile(batchinfer_home):
    from transformers import AutoTokenizer

    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.conftest import run_dag, xcom_value

    state, tasks, run_id = run_dag("batchinfer_ticket_summaries", num_tickets=20)
    assert state == "success", tasks
    run_key = sanitize_run_key(run_id)
    manifest = committed_manifest(str(batchinfer_home / "stage" / "summaries" / "tickets" / run_key))
    assert manifest["counts"] == {"input_rows": 20, "output_rows": 20, "error_rows": 0}
    assert manifest["columns"] == {"passthrough": ["ticket_id"], "outputs": ["choices", "usage"]}
    out = pq.read_table([f"{manifest['run_dir']}/{f['name']}" for f in manifest["files"]]).sort_by("ticket_id")
    prepared = pq.read_table(batchinfer_home / "stage" / "prepared" / "ticket_chats" / run_key).sort_by("ticket_id")
    assert out.column("ticket_id").to_pylist() == prepared.column("ticket_id").to_pylist() == list(range(1, 21))
    model = manifest["model"]
    tokenizer = AutoTokenizer.from_pretrained(
        str(ModelRegistry(str(batchinfer_home / "registry")).local_copy(model["name"], model["version"]) / "artifact")
    )
    usage, choices = out.column("usage").to_pylist(), out.column("choices").to_pylist()
    for messages, u, c in zip(prepared.column("messages").to_pylist(), usage, choices, strict=False):
        (choice,) = c
        content = choice["message"]["content"]
        assert choice["message"]["role"] == "assistant" and content and choice["finish_reason"] in ("stop", "length")
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        eos = 1 if choice["finish_reason"] == "stop" else 0  # the EOS token counts, as in vLLM
        assert u["prompt_tokens"] == len(prompt)
        assert u["completion_tokens"] == len(tokenizer(content, add_special_tokens=False)["input_ids"]) + eos
        assert u["completion_tokens"] <= 24 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    report_path = xcom_value("batchinfer_ticket_summaries", run_id, "publish")
    report = json.loads(Path(report_path).read_text())
    assert report["rows"] == 20 and report["total_tokens"] == sum(u["total_tokens"] for u in usage)
    assert sum(report["finish_reasons"].values()) == 20


@pytest.mark.usefixtures("airflow_db")
def test_image_labels_dag_reads_real_image_files_from_the_stage(batchinfer_home):
    from tests.conftest import run_dag, xcom_value

    state, tasks, run_id = run_dag("batchinfer_image_labels", num_images=12)
    assert state == "success", tasks
    run_key = sanitize_run_key(run_id)
    images = sorted(os.listdir(batchinfer_home / "stage" / "images" / "products" / run_key))
    assert {name.rsplit(".", 1)[1] for name in images} == {"png", "jpg"} and len(images) == 12
    manifest = committed_manifest(str(batchinfer_home / "stage" / "labels" / "product_images" / run_key))
    assert manifest["counts"]["output_rows"] == 12
    out = pq.read_table([f"{manifest['run_dir']}/{f['name']}" for f in manifest["files"]]).sort_by("product_id")
    assert out.column_names == ["product_id", "color", "label", "score"]
    assert out.column("label").to_pylist() == out.column("color").to_pylist()  # the pixels really reached the model
    assert all(0.5 < s <= 1 for s in out.column("score").to_pylist())
    report = json.loads(Path(xcom_value("batchinfer_image_labels", run_id, "publish")).read_text())
    assert report["agreement"] == 1.0 and report["rows"] == 12


# --- on a GPU: the real vLLM engine ------------------------------------------------------------------------


def _no_gpu_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm not installed (pip install 'airflow-provider-batchinfer[llm]' on a CUDA machine)"
    import torch

    return None if torch.cuda.is_available() else "no CUDA GPU"


@pytest.mark.skipif(_no_gpu_reason() is not None, reason=_no_gpu_reason() or "")
def test_vllm_engine_on_a_gpu_end_to_end(registry, tmp_path):
    """Runs the job through ray.data.llm's vLLM engine on a tiny Llama (head size 64, fp16) and
    reports its throughput; the same output shape and token reconciliation as on CPU."""
    from transformers import AutoTokenizer

    model_dir = build_tiny_chat_model(tmp_path / "gpu-model", hidden_size=128, num_heads=2)
    mv = registry.log_model("gpu_chat", "v1", "text_generation", str(model_dir))
    n = 2000
    table = text_to_messages(
        pa.table({"ticket_id": list(range(n)), "text": [f"the billing page fails {i}" for i in range(n)]}),
        "summarize the support ticket : {text}",
    )
    (tmp_path / "input").mkdir()
    pq.write_table(table.select(["ticket_id", "messages"]), tmp_path / "input" / "t.parquet")
    run_dir = Stage.open(str(tmp_path / "out"))
    spec = job_file(
        run_dir.location,
        mv,
        registry.root,
        [tmp_path / "input"],
        job_id="t-gpu",
        attempt="t01gpu",
        input_spec=InputSpec(params={"temperature": 0, "max_tokens": 32}),
        job_spec=JobSpec(
            num_gpus=1,
            max_batch_rows=256,
            engine_kwargs={"max_model_len": 256, "dtype": "half", "enforce_eager": True, "gpu_memory_utilization": 0.3},
        ),
        file_roots=[tmp_path],
    )
    # a fresh local Ray with every CPU and GPU of the machine, not the tests' 2-CPU head
    rc, output = run_runtime(write_job_file(spec), RAY_ADDRESS="")
    assert rc == 0, output[-3000:]
    manifest = committed_manifest(run_dir.location)
    assert manifest["counts"]["output_rows"] == n
    out = pq.read_table([f"{manifest['run_dir']}/{f['name']}" for f in manifest["files"]])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = out.sort_by("ticket_id")
    assert out.column("ticket_id").to_pylist() == list(range(n))
    prompts = table.column("messages").to_pylist()
    for messages, u, c in zip(
        prompts[:50], out.column("usage").to_pylist()[:50], out.column("choices").to_pylist()[:50], strict=False
    ):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert u["prompt_tokens"] == len(prompt)
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and 0 < u["completion_tokens"] <= 32
        assert c[0]["finish_reason"] == ("length" if u["completion_tokens"] == 32 else "stop")
    print(
        f"vLLM on GPU: {n} rows, {manifest['timings']['rows_per_s']} rows/s over the pipeline, "
        f"{manifest['timings']['steady_rows_per_s']} rows/s steady, {manifest['timings']['total_s']} s in total"
    )
