"""Any Python class with ``load(path)`` and ``predict(batch)``, for models no other flavor covers.

The class's source was copied into the version at log time and is imported from there, so every
worker runs exactly the code that was logged and hashed. A version logged as ``"pkg:Class"``
without ``code_paths`` holds no code: its class is imported from whatever the worker has installed,
which no digest covers. Such an *unhashed import* is allowed (a class from an installed package),
but never silent: the driver's log and the ``_SUCCESS`` manifest name it (:func:`unhashed_imports`),
and each replica's log names the file it was imported from. ``predict`` gets a pandas DataFrame of
the input columns and returns a DataFrame or a dict of equally long columns.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor


def unhashed_imports(manifest: dict[str, Any]) -> tuple[str, ...]:
    """``("module:Class",)`` when a python version imports a module its own code directory does
    not hold (logged as ``"pkg:Class"`` without ``code_paths``); ``()`` otherwise."""
    if manifest.get("flavor") != "python":
        return ()
    options = manifest["options"]
    top = str(options["module"]).split(".")[0]
    code = str(options.get("code_dir") or "")
    files = manifest.get("files") or {}
    held = code and any(rel == f"{code}/{top}.py" or rel.startswith(f"{code}/{top}/") for rel in files)
    return () if held else (f"{options['module']}:{options['class']}",)


def unhashed_message(imports: tuple[str, ...] | list[str], model: str) -> str:
    return (
        f"model {model} imports {', '.join(imports)} from the worker's installed packages, not from code "
        "logged with the version: its sha256 does not cover that code. Log it with code_paths (or the class "
        "itself) to pin it"
    )


def preflight(model_dir: Path | None, manifest: dict[str, Any]) -> list[str]:
    """The driver's log line for an unhashed import (the manifest records it too)."""
    imports = unhashed_imports(manifest)
    return [unhashed_message(imports, f"{manifest['name']}/{manifest['version']}")] if imports else []


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    options = manifest["options"]
    code_dir = str(model_dir / options["code_dir"])
    if code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    # no __pycache__ beside the logged code: the version must stay exactly the files that were hashed
    # (the next job's check refuses any file added since), and bytecode is not part of what was logged
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        module = importlib.import_module(options["module"])
    finally:
        sys.dont_write_bytecode = writes_bytecode
    source = Path(getattr(module, "__file__", None) or "<built-in>")
    if not source.resolve().is_relative_to(Path(code_dir).resolve()):
        named = f"{manifest.get('name')}/{manifest.get('version')}"
        imported = [f"{options['module']}:{options['class']}"]
        print(f"[batchinfer] {unhashed_message(imported, named)} (imported from {source})", flush=True)
    cls = module
    for part in options["class"].split("."):
        cls = getattr(cls, part)
    artifact = None
    if options.get("artifact"):
        artifact = model_dir / options["artifact"]
        if options.get("artifact_file"):
            artifact = artifact / options["artifact_file"]
    instance = cls.load(str(artifact) if artifact is not None else None)

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        frame = inputs.to_pandas()
        out = instance.predict(frame, **params) if params else instance.predict(frame)
        if hasattr(out, "to_dict") and hasattr(out, "columns"):
            return {str(c): out[c].to_numpy() for c in out.columns}
        if not isinstance(out, dict):
            raise TypeError(
                f"{options['class']}.predict must return a DataFrame or a dict of columns, got {type(out).__name__}"
            )
        return out

    return predict


# transfer_rows 0: predict() gets at most JobSpec.max_batch_rows rows, as the user sized it (unset:
# Tuning.call_rows)
FLAVOR = Flavor(name="python", load=load, preflight=preflight, transfer_rows=0)
