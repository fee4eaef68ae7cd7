"""The ``transformers_pipeline`` flavor's registry side: which tasks it runs, what each reads and
writes, and how a pipeline (or its ``save_pretrained`` directory) is staged into a version.

The task table is plain data shared with the runtime adapter, so the signature a version is logged
with and the columns its replicas produce cannot drift apart. Only tasks whose inputs are text or
one file per row are here; a task outside the table is refused at log time with the list.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.versions import RegistryError

PIPELINE_FLAVOR = "transformers_pipeline"
_TEXT = {"text": "string"}
_SCORED = "list<struct<label:string,score:float32>>"
_ENTITIES = "list<struct<entity:string,score:float32,word:string,start:int64,end:int64>>"

# task -> its one input column and every output column it can produce (the default signature
# keeps all of them; a logged signature may keep a subset and rename the input)
PIPELINE_TASKS: dict[str, dict[str, dict[str, str]]] = {
    "text-classification": {"inputs": _TEXT, "outputs": {"label": "string", "score": "float32", "top_k": _SCORED}},
    "token-classification": {"inputs": _TEXT, "outputs": {"entities": _ENTITIES}},
    "zero-shot-classification": {
        "inputs": _TEXT,
        "outputs": {"label": "string", "score": "float32", "labels": "list<string>", "scores": "list<float32>"},
    },
    # one vector per token (the pipeline's own output); pooling is the sentence_transformers flavor's job
    "feature-extraction": {"inputs": _TEXT, "outputs": {"embedding": "list<list<float32>>"}},
    # transformers 5 dropped these three pipelines: the flavor runs the model's generate() itself
    "summarization": {"inputs": _TEXT, "outputs": {"summary_text": "string"}},
    "translation": {"inputs": _TEXT, "outputs": {"translation_text": "string"}},
    "text2text-generation": {"inputs": _TEXT, "outputs": {"generated_text": "string"}},
    # the audio file's bytes: InputSpec.column_handling={"<path column>": "bytes"} reads them
    "automatic-speech-recognition": {"inputs": {"audio": "binary"}, "outputs": {"text": "string"}},
}
TASK_ALIASES = {
    "sentiment-analysis": "text-classification",
    "ner": "token-classification",
    "asr": "automatic-speech-recognition",
}
SEQ2SEQ_TASKS = ("summarization", "translation", "text2text-generation")
_DEFAULT_OUTPUTS = {"text-classification": ["label", "score"]}


def canonical_task(task: str) -> str:
    """The table's name for ``task``: aliases resolved, ``translation_en_to_fr`` is ``translation``."""
    if not isinstance(task, str) or not task:
        raise RegistryError(f"a {PIPELINE_FLAVOR} model needs task=<one of {sorted(PIPELINE_TASKS)}>")
    name = TASK_ALIASES.get(task, task)
    if name.startswith("translation_"):
        name = "translation"
    if name not in PIPELINE_TASKS:
        raise RegistryError(
            f"pipeline task {task!r} is not supported by the {PIPELINE_FLAVOR} flavor; supported tasks: "
            f"{', '.join(sorted(PIPELINE_TASKS))} (aliases {', '.join(sorted(TASK_ALIASES))}). For other models "
            "log a python flavor class"
        )
    return name


def pipeline_signature(task: str, signature: dict[str, Any] | None) -> dict[str, Any]:
    """The default signature of ``task``, or the given one checked against it: one input column
    (any name, the task's dtype) and outputs the task produces, with their dtypes."""
    spec = PIPELINE_TASKS[canonical_task(task)]
    default_outputs = _DEFAULT_OUTPUTS.get(canonical_task(task), list(spec["outputs"]))
    if signature is None:
        return {"inputs": dict(spec["inputs"]), "outputs": {o: spec["outputs"][o] for o in default_outputs}}
    inputs, outputs = dict(signature.get("inputs") or spec["inputs"]), dict(signature.get("outputs") or {})
    (want_dtype,) = spec["inputs"].values()
    if len(inputs) != 1 or next(iter(inputs.values())) != want_dtype:
        raise RegistryError(
            f"a {task} pipeline reads one input column of dtype {want_dtype!r}, e.g. "
            f"{json.dumps(spec['inputs'])}; the signature gives {json.dumps(inputs)}"
        )
    unknown = {c: t for c, t in outputs.items() if spec["outputs"].get(c) != t}
    if unknown:
        raise RegistryError(
            f"a {task} pipeline produces {json.dumps(spec['outputs'])}; the signature asks for {json.dumps(unknown)}"
        )
    return {"inputs": inputs, "outputs": outputs or {o: spec["outputs"][o] for o in default_outputs}}


def stage_pipeline(art: Path, artifact: Any, task: str | None) -> dict[str, Any]:
    """Write the pipeline's files into ``art`` and return the version's options.

    ``artifact``: a ``transformers.Pipeline`` (its task is used unless ``task`` is given), a
    ``save_pretrained`` directory (``task`` required), or ``(model, tokenizer_or_processor)``.
    Refused here rather than on a worker: an unknown task, weights that are not safetensors (a
    pickle would run code when loaded), custom modelling code (``auto_map``: it would need
    ``trust_remote_code``), a text task without a tokenizer, zero-shot without an entailment label.
    """
    if hasattr(artifact, "task") and hasattr(artifact, "model") and hasattr(artifact, "save_pretrained"):
        task = task or artifact.task
        art.mkdir()
        artifact.save_pretrained(str(art))
    elif isinstance(artifact, (str, os.PathLike)):
        if not Path(artifact).is_dir():
            raise RegistryError(f"{PIPELINE_FLAVOR} artifact {artifact!s} is not a directory (save_pretrained output)")
        shutil.copytree(artifact, art, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".cache"))
    elif isinstance(artifact, (tuple, list)) and artifact and all(hasattr(a, "save_pretrained") for a in artifact):
        art.mkdir()
        for part in artifact:
            part.save_pretrained(str(art))
    else:
        raise RegistryError(
            f"a {PIPELINE_FLAVOR} model needs artifact=<transformers.pipeline(...)>, a save_pretrained directory "
            f"and task=..., or (model, tokenizer); got {type(artifact).__name__}"
        )
    if task is None:
        raise RegistryError(f"a {PIPELINE_FLAVOR} directory needs task=<one of {sorted(PIPELINE_TASKS)}>")
    name = canonical_task(task)
    check_pipeline_dir(art, name)
    return {"dir": art.name, "task": task}


def check_pipeline_dir(path: Path, task: str, component_dirs: list[Path] | tuple[Path, ...] = ()) -> None:
    """What a worker needs to load ``path`` offline and safely, checked at log time.
    ``component_dirs``: where the tokenizer or processor lives when not beside the model (MLflow)."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise RegistryError(f"{PIPELINE_FLAVOR} artifact has no config.json; save the model with save_pretrained")
    config = json.loads(config_file.read_text())
    if config.get("auto_map"):
        raise RegistryError(
            f"{PIPELINE_FLAVOR} model uses custom modelling code (config.json auto_map), which would need "
            "trust_remote_code; log it as a python flavor class instead"
        )
    names = {p.name for p in path.iterdir()}
    if not any(n.endswith(".safetensors") for n in names):
        pickled = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")))
        raise RegistryError(
            f"{PIPELINE_FLAVOR} artifact has no .safetensors weights ({pickled or 'no weights at all'}): pickled "
            "weights can run code when loaded; re-save with model.save_pretrained(dir), which writes safetensors"
        )
    parts = names | {p.name for d in component_dirs if d.is_dir() for p in d.iterdir()}
    if task == "automatic-speech-recognition":
        if not parts & {"preprocessor_config.json", "processor_config.json"}:
            raise RegistryError(
                "an automatic-speech-recognition model needs its feature extractor: save the processor "
                "(processor.save_pretrained(dir)) beside the model"
            )
    elif not parts & {"tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model"}:
        raise RegistryError(
            f"a {task} model needs its tokenizer in the directory: tokenizer.save_pretrained(dir) beside the model"
        )
    if task == "zero-shot-classification":
        labels = [str(k).lower() for k in (config.get("label2id") or {})]
        if not any(label.startswith("entail") for label in labels):
            raise RegistryError(
                "a zero-shot-classification model must be an NLI model with an 'entailment' label in its "
                f"config.json label2id (it has {sorted(config.get('label2id') or {})})"
            )
