"""The vLLM engine is handed a node-local copy hashed on its node, never the registry's URI.

vLLM cannot run here (no GPU, no vllm): what is checked is what its constructor would be given.
``ray.data.llm``'s own ``vLLMEngineStageUDF`` is constructed through the guard every stage gets
(``llm.verified_stage_class``); its constructor runs until it imports vllm, and the frame that
raised holds the model source it was about to hand the engine. A same-size swap of a weights file
or of ``config.json`` on the S3 server is refused before that constructor runs."""

from __future__ import annotations

import shutil
import sys
import traceback
from pathlib import Path

import boto3
import pytest

from airflow_provider_batchinfer.contract import ModelRef
from airflow_provider_batchinfer.contract.specs import JobSpec
from airflow_provider_batchinfer.registry import ModelRegistry, TamperedModelError, verify_local_copy
from airflow_provider_batchinfer.registry.demo_models import build_tiny_chat_model
from airflow_provider_batchinfer.runtime.model import llm


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture
def s3_chat(s3_server, s3_bucket, chat_dir, monkeypatch):
    """A tiny chat model logged into an S3 registry; (registry, its ModelRef, an S3 client)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unused")
    registry = ModelRegistry(f"s3://{s3_bucket}/registry", {"endpoint_url": s3_server, "region": "us-east-1"})
    mv = registry.log_model("chat", "v1", "text_generation", str(chat_dir))
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    return registry, ModelRef.from_dict(mv.to_dict()), client


def _swap_same_size(client, bucket: str, key: str) -> None:
    """Overwrite one object on the S3 server with bytes of the same length (a listing sees no change)."""
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    swapped = bytes([body[0] ^ 0x01]) + body[1:] if not key.endswith(".json") else body.replace(b"32", b"64", 1)
    assert len(swapped) == len(body) and swapped != body
    client.put_object(Bucket=bucket, Key=key, Body=swapped)


def _engine_udf(source: llm.VerifiedSource):
    from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

    guarded = llm.verified_stage_class(vLLMEngineStageUDF, source)
    return lambda: guarded(
        data_column="__data",
        expected_input_keys=["prompt"],
        batch_size=4,
        max_concurrent_batches=1,
        model=source.path,
        engine_kwargs={"tensor_parallel_size": 1},
    )


def _handed_to_engine(exc: BaseException) -> str | None:
    """The model source vLLM's wrapper held when its constructor stopped (it imports vllm last)."""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        me = frame.f_locals.get("self")
        if type(me).__name__ == "vLLMEngineWrapper":
            return str(me.model_source)
    return None


def test_the_engine_gets_a_node_local_copy_rehashed_on_its_node(s3_chat, s3_bucket, tmp_path):
    registry, model, _ = s3_chat
    source = llm.model_source(registry, model, cache_dir=str(tmp_path / "cache"))
    assert not source.path.startswith("s3://") and Path(source.path).is_relative_to(tmp_path / "cache")
    assert verify_local_copy(Path(source.path), model.sha256, name="chat", version="v1")["flavor"] == "text_generation"
    assert llm.processor_config(source.path, JobSpec(num_gpus=1))["model_source"] == source.path
    with pytest.raises(llm.LLMEngineError, match="only a verified node-local copy"):
        llm.processor_config(model.uri, JobSpec(num_gpus=1))

    shutil.rmtree(source.path)  # an engine node that holds no copy yet makes its own from S3
    with pytest.raises(ImportError) as raised:  # the engine's own constructor ran, up to `import vllm`
        _engine_udf(source)()
    if "vllm" in sys.modules:  # pragma: no cover - only where vllm is installed
        pytest.skip("vllm is installed here; the engine would start")
    assert _handed_to_engine(raised.value) == source.path
    verify_local_copy(Path(source.path), model.sha256, name="chat", version="v1")  # made and hashed by the actor


@pytest.mark.parametrize("swapped", ["config.json", "weights"])
def test_a_same_size_swap_on_s3_is_refused_before_the_engine_is_built(s3_chat, s3_bucket, tmp_path, swapped):
    registry, model, client = s3_chat
    source = llm.model_source(registry, model, cache_dir=str(tmp_path / "cache"))
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="registry/chat/v1/")["Contents"]]
    pick = "config.json" if swapped == "config.json" else ".safetensors"
    key = next(k for k in keys if k.endswith(pick))
    _swap_same_size(client, s3_bucket, key)
    registry.check_listing("chat", "v1", model.sha256)  # the listing the Airflow side checks sees nothing
    name = key.rsplit("/", 1)[-1]

    # an engine node without a copy: its actor downloads, re-hashes and refuses before the engine's constructor
    shutil.rmtree(source.path)
    with pytest.raises(TamperedModelError, match=rf"{name} does not match its recorded sha256") as raised:
        _engine_udf(source)()
    assert _handed_to_engine(raised.value) is None
    assert not Path(source.path).exists()  # nothing left where the engine would read
    # the driver, building the processor config, refuses it too (a fresh node's cache)
    with pytest.raises(TamperedModelError, match=rf"{name} does not match.*downloaded just now from s3://"):
        llm.model_source(registry, model, cache_dir=str(tmp_path / "another-driver"))
