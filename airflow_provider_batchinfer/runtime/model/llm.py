"""The vLLM engine for ``text_generation`` models, through ``ray.data.llm`` (the ``[llm]`` extra).

``ray.data.llm`` builds the whole GPU pipeline (chat template -> tokenize -> vLLM engine ->
detokenize, each a Ray Data stage sized on its own); this module only maps our contract onto it:

- ``JobSpec``: ``replicas`` -> engine ``concurrency``, ``max_batch_rows`` -> ``batch_size`` (unset:
  ``Tuning.call_rows``, through ``flavors.call_rows`` as every flavor's calls),
  ``num_gpus`` -> ``tensor_parallel_size`` (unless ``engine_kwargs`` sets it), ``engine_kwargs``
  (``max_model_len``, ``dtype``, ...) -> vLLM as is;
- ``InputSpec.params`` and a row's ``sampling_params`` -> vLLM sampling parameters;
- vLLM's output (``generated_text``, ``num_input_tokens``, ``num_generated_tokens``) -> the same
  ``choices`` / ``usage`` columns the transformers engine writes, joined to the passthrough ids.

Which engine runs is decided once per job (:func:`resolve_engine`), and a job that asks for vLLM
without vLLM installed, without ``num_gpus`` or on a cluster without GPUs fails before any work,
with what to change. Nothing here imports vllm or ray at module level.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, NamedTuple

from airflow_provider_batchinfer.contract.chat import finish_reason, response, response_types, sampling_params
from airflow_provider_batchinfer.contract.placement import LLM_FLAVOR, chosen_engine
from airflow_provider_batchinfer.runtime.model.dereference import dereference_messages, normalize_roots, parse_messages
from airflow_provider_batchinfer.runtime.model.flavors import call_rows

INSTALL_HINT = "pip install 'airflow-provider-batchinfer[llm]' (vllm and ray[llm]) in the image the Ray workers run"


class LLMEngineError(RuntimeError):
    """The requested LLM engine cannot run here; the message says what to change."""


def resolve_engine(flavor: str, job: Any, default_engine: str | None = None) -> str | None:
    """``None`` for models that are not text generation; else ``"vllm"`` or ``"transformers"``, as
    ``contract/placement.chosen_engine`` picks it, checked."""
    if flavor != LLM_FLAVOR:
        if job.engine is not None:
            raise LLMEngineError(
                f"JobSpec.engine={job.engine!r} applies to text_generation models, not {flavor}; drop it"
            )
        return None
    engine = chosen_engine(job.engine, default_engine, job.num_gpus)
    if engine not in ("vllm", "transformers"):
        raise LLMEngineError(f"llm_engine={engine!r} in the connection: use 'vllm' or 'transformers'")
    return engine


def gpus_per_replica(job: Any) -> int:
    kwargs = job.engine_kwargs
    tp = int(kwargs.get("tensor_parallel_size") or max(1, int(job.num_gpus)))
    pp = int(kwargs.get("pipeline_parallel_size") or 1)
    return tp * pp


def check_vllm_job(job: Any, find_spec: Any = importlib.util.find_spec) -> None:
    """Before Ray starts: the job asks for GPUs and vLLM is importable."""
    if job.num_gpus <= 0:
        raise LLMEngineError(
            "the vLLM engine runs on GPUs, but JobSpec.num_gpus is 0: set JobSpec(num_gpus=1) (or more, for "
            "tensor parallelism), or run on CPU with JobSpec(engine='transformers')"
        )
    missing = [name for name in ("vllm",) if find_spec(name) is None]
    if missing:
        raise LLMEngineError(
            f"the vLLM engine needs the vllm package, which is not installed here: {INSTALL_HINT}; "
            "or run on CPU with JobSpec(engine='transformers')"
        )


def check_cluster(job: Any, cluster: dict[str, float]) -> None:
    """After Ray starts: the cluster has the GPUs one engine replica needs."""
    need = gpus_per_replica(job)
    have = float(cluster.get("GPU", 0))
    if have < need:
        raise LLMEngineError(
            f"the vLLM engine needs {need} GPU(s) per replica (tensor_parallel_size x pipeline_parallel_size) but the "
            f"Ray cluster has {have:g}: no CUDA GPU is available to this job. Run on a GPU cluster (launcher "
            "ray_jobs) or on CPU with JobSpec(engine='transformers')"
        )


def _multimodal(config: dict[str, Any]) -> bool:
    return any(k in config for k in ("vision_config", "audio_config", "image_token_id", "audio_token_id"))


def is_multimodal(model_dir: Path) -> bool:
    """Vision/audio models need ray.data.llm's multimodal stage to load the images in messages."""
    config_path = Path(model_dir) / "config.json"
    return _multimodal(json.loads(config_path.read_text()) if config_path.exists() else {})


class VerifiedSource(NamedTuple):
    """The one path every ``ray.data.llm`` stage loads the model from, and how each node makes it.

    ``path`` is a node-local copy in the private model cache (``registry/fetch.py``), keyed by the
    pinned ``sha256`` and the registry location under ``cache_root``: the same string on every node,
    so one ``model_source`` serves the whole cluster. ``uri`` (the registry location) is never handed
    to an engine; each stage's actor makes and re-hashes its node's copy from it first
    (:func:`guard_stages`)."""

    path: str
    uri: str
    sha256: str
    cache_root: str
    storage_options: dict[str, Any] | None
    multimodal: bool


def model_source(registry: Any, model: Any, cache_dir: str | None = None) -> VerifiedSource:
    """The verified node-local copy the vLLM engine is given, made and re-hashed here first.

    ``ray.data.llm`` reads the model in this (the driver's) process too: it reads ``config.json``
    (importing the model's own code with ``trust_remote_code``) while it builds the processor. So
    the driver holds a verified copy as well, at the same path the stages use; a file swapped in the
    registry since the model was logged (same size or not) is refused here, before anything reads it.
    """
    from airflow_provider_batchinfer.registry.fetch import fetch_version, model_cache_dir

    root = model_cache_dir(cache_dir)
    storage = dict(registry.storage_options) if registry.storage_options else None
    path, _ = fetch_version(model.uri, model.sha256, storage, cache_dir=str(root))
    return VerifiedSource(str(path), model.uri, model.sha256, str(root), storage, is_multimodal(path))


def ensure_on_node(source: VerifiedSource) -> Path:
    """This node's verified copy at ``source.path``: fetched when missing, re-hashed every time.
    Runs in each stage's actor before the stage's constructor reads the model."""
    from airflow_provider_batchinfer.registry.fetch import fetch_version

    path, _ = fetch_version(source.uri, source.sha256, source.storage_options, cache_dir=source.cache_root)
    if str(path) != source.path:
        raise LLMEngineError(
            f"the model's verified copy on this node is {path}, not {source.path} as the engine was told; "
            "check that BATCHINFER_MODEL_CACHE names a directory every node can create"
        )
    return path


def _stage_models(stage: Any) -> list[str]:
    """The model locations a ``ray.data.llm`` stage's constructor will read."""
    kwargs = dict(stage.fn_constructor_kwargs)
    found = [kwargs["model"]] if kwargs.get("model") is not None else []
    nested = kwargs.get("model_config_kwargs") or {}
    if nested.get("model") is not None:  # the multimodal stage
        found.append(nested["model"])
    return [str(m) for m in found]


def verified_stage_class(fn: type, source: VerifiedSource) -> type:
    """``fn`` (a ``ray.data.llm`` stage's UDF class) whose constructor first makes and re-hashes
    this node's copy of the model (:func:`ensure_on_node`): the stage's actor loads only bytes that
    were hashed on its own node, and a copy that does not match the pinned sha256 fails the actor
    before ``fn``'s own constructor (the vLLM engine's included) reads anything."""

    base_init = getattr(fn, "__init__")  # noqa: B009 - the class's constructor, not an instance's

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        ensure_on_node(source)
        base_init(self, *args, **kwargs)

    # the UDF's own name: Ray Data names the stage's operator after it
    return type(fn.__name__, (fn,), {"__init__": __init__, "__module__": __name__, "__doc__": fn.__doc__})


def guard_stages(processor: Any, source: VerifiedSource) -> list[str]:
    """Wrap every stage of ``processor`` that reads a model in :func:`verified_stage_class`; refuse a
    stage that would read the model from anywhere but ``source.path``. Returns the guarded stages' names."""
    guarded = []
    for name, stage in processor.stages.items():
        models = _stage_models(stage)
        if not models:
            continue
        elsewhere = [m for m in models if m != source.path]
        if elsewhere:
            raise LLMEngineError(
                f"ray.data.llm stage {name} would read the model from {elsewhere[0]}, not the verified copy "
                f"{source.path}; this Ray version builds its stages differently from what the provider supports"
            )
        stage.fn = verified_stage_class(stage.fn, source)
        guarded.append(name)
    return guarded


def processor_config(model_dir: Path | str, job: Any, multimodal: bool | None = None) -> dict[str, Any]:
    """Keyword arguments of ``ray.data.llm.vLLMEngineProcessorConfig`` for this job (pure);
    ``model_dir`` is the verified node-local copy (:func:`model_source`), never a registry URI."""
    if "://" in str(model_dir):
        raise LLMEngineError(
            f"the vLLM engine is given only a verified node-local copy of the model, not {model_dir}: "
            "pass llm.model_source(...).path"
        )
    engine_kwargs = dict(job.engine_kwargs)
    engine_kwargs.setdefault("tensor_parallel_size", max(1, int(job.num_gpus)))
    return {
        "model_source": str(model_dir),
        "engine_kwargs": engine_kwargs,
        "concurrency": job.replicas,
        "batch_size": call_rows(LLM_FLAVOR, "cuda", job.max_batch_rows),  # vLLM runs on GPUs only
        "chat_template_stage": True,
        "tokenize_stage": True,
        "detokenize_stage": True,
        "prepare_multimodal_stage": is_multimodal(Path(model_dir)) if multimodal is None else multimodal,
    }


def vllm_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """Our checked sampling parameters as vLLM's ``SamplingParams`` fields."""
    # the processor's detokenize stage turns tokens into text; vLLM itself detokenizes only when it
    # must match stop strings (it refuses stop strings with detokenize=False)
    out: dict[str, Any] = {
        "temperature": float(params["temperature"]),
        "top_p": float(params["top_p"]),
        "max_tokens": int(params["max_tokens"]),
        "detokenize": bool(params["stop"]),
    }
    if params["stop"]:
        out["stop"] = list(params["stop"])
    if params["seed"] is not None:
        out["seed"] = int(params["seed"])
    return out


class Preprocess:
    """Row -> what the processor's first stage reads (``messages``, ``sampling_params``), keeping
    the passthrough columns; stage files in ``image_url`` / ``input_audio`` parts are inlined under
    the allowed roots, exactly as on the CPU path."""

    def __init__(
        self, message_col: str, passthrough: list[str], params: dict[str, Any], dereference: dict[str, Any] | None
    ) -> None:
        self.message_col = message_col
        self.passthrough = passthrough
        self.params = params
        self.dereference = dereference

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        messages = parse_messages(row[self.message_col], self.message_col)
        if self.dereference and self.message_col in self.dereference.get("messages", []):
            messages = dereference_messages(
                messages,
                normalize_roots(self.dereference["roots"]),
                self.dereference.get("storage_options"),
                self.message_col,
                self.dereference.get("url_hosts", ()),
            )
        sp = sampling_params(self.params, row.get("sampling_params"))
        return {
            **{c: row[c] for c in self.passthrough},
            "messages": messages,
            "sampling_params": vllm_sampling_params(sp),
        }


class Postprocess:
    """vLLM's output row -> the passthrough columns plus one OpenAI-shaped response."""

    def __init__(self, passthrough: list[str]) -> None:
        self.passthrough = passthrough

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        max_tokens = int(row["sampling_params"]["max_tokens"])
        generated = int(row["num_generated_tokens"])
        # vLLM stops early only at EOS or a stop string: fewer tokens than max_tokens means it stopped
        out = response(
            str(row["generated_text"]).strip(),
            finish_reason(generated, max_tokens, False),
            int(row["num_input_tokens"]),
            generated,
        )
        return {
            **{c: row[c] for c in self.passthrough},
            "choices": json.dumps(out["choices"]),
            "usage": json.dumps(out["usage"]),
        }


def to_response_table(batch: Any, passthrough: list[str], counter: Any = None) -> Any:
    """The final batch in exactly the CPU engine's Arrow types (JSON crossed the processor, so
    Ray never has to guess struct types from Python rows)."""
    import pyarrow as pa

    choices_type, usage_type = response_types()
    columns = {c: batch.column(c) for c in passthrough}
    columns["choices"] = pa.array([json.loads(v) for v in batch.column("choices").to_pylist()], choices_type)
    columns["usage"] = pa.array([json.loads(v) for v in batch.column("usage").to_pylist()], usage_type)
    if counter is not None:
        counter.add.remote(batch.num_rows)
        usage = columns["usage"]  # the job's input and output tokens (runtime/model/usage.py)
        counter.tokens.remote(
            sum(u["prompt_tokens"] or 0 for u in usage.to_pylist()),
            sum(u["completion_tokens"] or 0 for u in usage.to_pylist()),
        )
    return pa.table(columns)


def vllm_processor(
    source: VerifiedSource,
    job: Any,
    message_col: str,
    passthrough: list[str],
    params: dict[str, Any],
    dereference: dict[str, Any] | None,
) -> Any:
    """``ray.data.llm``'s vLLM processor for this job, every stage that reads the model guarded
    (:func:`guard_stages`)."""
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    processor = build_processor(
        vLLMEngineProcessorConfig(**processor_config(source.path, job, multimodal=source.multimodal)),
        preprocess=Preprocess(message_col, passthrough, params, dereference),
        postprocess=Postprocess(passthrough),
    )
    guarded = guard_stages(processor, source)
    print(
        f"[batchinfer] vLLM stages {', '.join(guarded)} load the model from {source.path}, "
        f"re-hashed against sha256 {source.sha256[:12]}… on each stage's node first",
        flush=True,
    )
    return processor


def build_pipeline(
    ds: Any,
    source: VerifiedSource,
    manifest_signature: dict[str, Any],
    plan: dict[str, Any],
    params: dict[str, Any],
    job: Any,
    counter: Any = None,
) -> Any:
    """``ds`` through the vLLM engine processor, ending in passthrough + ``choices`` + ``usage``;
    ``source`` is :func:`model_source`'s answer."""
    inputs = manifest_signature.get("inputs", {})
    message_col = next((m for m, t in inputs.items() if t == "messages"), "messages")
    names = dict(zip(plan["model_inputs"], plan["sources"], strict=False))
    column = names.get(message_col, message_col)
    passthrough = list(plan["passthrough"])
    if column != message_col or names.get("sampling_params", "sampling_params") != "sampling_params":
        ds = ds.rename_columns({s: m for m, s in names.items() if s != m})
    processor = vllm_processor(source, job, message_col, passthrough, params, plan.get("dereference"))
    return processor(ds).map_batches(
        to_response_table, batch_format="pyarrow", fn_kwargs={"passthrough": passthrough, "counter": counter}
    )
