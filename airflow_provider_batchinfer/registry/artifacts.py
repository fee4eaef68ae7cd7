"""Staging what log_model is given: signatures, save_pretrained directories, Python classes."""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.versions import (
    RegistryError,
)


def normalize_signature(signature: dict[str, Any] | None, flavor: str) -> dict[str, Any]:
    """``{"inputs": {col: dtype}, "outputs": {col: dtype}}``, ordered: the order of inputs is the
    order a tabular model stacks its features in."""
    defaults: dict[str, dict[str, Any]] = {
        "sentence_transformers": {"inputs": {"text": "string"}, "outputs": {"embedding": "list<float32>"}},
        "python": {"inputs": {}, "outputs": {}},
        # messages: OpenAI chat messages (list of structs or JSON); sampling_params: optional per-row overrides
        "text_generation": {
            "inputs": {"messages": "messages", "sampling_params": "optional"},
            "outputs": {"choices": "list<struct>", "usage": "struct"},
        },
        "image_classification": {"inputs": {"image": "binary"}, "outputs": {"label": "string", "score": "float32"}},
    }
    if signature is None:
        if flavor not in defaults:
            raise RegistryError(
                f"flavor {flavor!r} needs a signature: {{'inputs': {{column: dtype, ...}}, 'outputs': {{column: dtype}}}}"
            )
        signature = defaults[flavor]
    if not isinstance(signature, dict) or set(signature) - {"inputs", "outputs"}:
        raise RegistryError("signature must be a dict with 'inputs' and 'outputs', each {column: dtype}")
    result = {}
    for key in ("inputs", "outputs"):
        cols = signature.get(key, {})
        if not isinstance(cols, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in cols.items()):
            raise RegistryError(f"signature[{key!r}] must be a dict of {{column name: dtype string}}, got {cols!r}")
        result[key] = dict(cols)
    if flavor == "torchscript" and not result["inputs"]:
        raise RegistryError("a torchscript model's signature must name its input columns, in feature order")
    if flavor == "torchscript" and not result["outputs"]:
        raise RegistryError("a torchscript model's signature must name its output column(s)")
    return result


def _stage_pretrained(art: Path, flavor: str, artifact: Any) -> None:
    """Copy a ``save_pretrained`` directory, or save ``(model, tokenizer_or_processor)`` into one.

    A chat model without a chat template is refused here, at log time, rather than on a worker."""
    what = "tokenizer" if flavor == "text_generation" else "image processor"
    if isinstance(artifact, (str, os.PathLike)):
        if not Path(artifact).is_dir():
            raise RegistryError(f"{flavor} artifact {artifact!s} is not a directory (save_pretrained output)")
        shutil.copytree(artifact, art, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".cache"))
    elif (
        isinstance(artifact, (tuple, list))
        and len(artifact) == 2
        and all(hasattr(a, "save_pretrained") for a in artifact)
    ):
        art.mkdir()
        for part in artifact:
            part.save_pretrained(str(art))
    else:
        raise RegistryError(
            f"a {flavor} model needs artifact=<directory written by save_pretrained> or (model, {what}), "
            f"got {type(artifact).__name__}"
        )
    if not (art / "config.json").exists():
        raise RegistryError(f"{flavor} artifact has no config.json; save the model with save_pretrained")
    if flavor == "text_generation":
        config = (
            json.loads((art / "tokenizer_config.json").read_text()) if (art / "tokenizer_config.json").exists() else {}
        )
        if not (art / "chat_template.jinja").exists() and not config.get("chat_template"):
            raise RegistryError(
                "a text_generation model needs a tokenizer with a chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template); set tokenizer.chat_template before saving"
            )


def _python_class_source(python_class: Any, code_paths: list[str] | None) -> tuple[str, str, list[str]]:
    """(module name, class name, files to copy) for a Python-flavor model.

    A class object is located through its source file, which is copied with the model, so the Ray
    workers import exactly the code that was logged. A ``"module:Class"`` string needs
    ``code_paths`` (or a module the workers can already import).
    """
    if isinstance(python_class, str):
        if ":" not in python_class:
            raise RegistryError(f"python_class {python_class!r} must look like 'module:ClassName'")
        module, qualname = python_class.split(":", 1)
        return module, qualname, list(code_paths or [])
    if not inspect.isclass(python_class):
        raise RegistryError(f"python_class must be a class or 'module:ClassName', got {type(python_class).__name__}")
    for method in ("load", "predict"):
        if not callable(getattr(python_class, method, None)):
            raise RegistryError(f"python_class {python_class.__name__} has no {method}() method")
    source = inspect.getsourcefile(python_class)
    if not source:
        raise RegistryError(
            f"cannot find the source file of {python_class.__name__}; pass 'module:Class' and code_paths"
        )
    module = Path(source).stem
    return module, python_class.__qualname__, [source, *(code_paths or [])]
