"""What a model version is: its names, its errors, and the hashes that pin it."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.store.locations import StageError

MODEL_MANIFEST = "MODEL.json"
REGISTRY_FORMAT = "batchinfer.model/1"
FLAVORS = (
    "torchscript",
    "sentence_transformers",
    "python",
    "text_generation",
    "image_classification",
    # traditional models (registry/tabular.py)
    "sklearn",
    "xgboost",
    "lightgbm",
    "onnx",
    # Hugging Face pipelines and MLflow models
    "transformers_pipeline",
    "mlflow_pyfunc",
)
# flavors whose artifact is a transformers save_pretrained directory (model + tokenizer/processor)
PRETRAINED_FLAVORS = ("text_generation", "image_classification")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RegistryError(StageError):
    """A model or version that cannot be logged or used; the message says what to do."""


class ModelNotFoundError(RegistryError):
    pass


class ModelVersionExistsError(RegistryError):
    pass


class TamperedModelError(RegistryError):
    """The files of a logged version no longer match the hashes recorded when it was logged."""


@dataclass(frozen=True)
class ModelVersion:
    """A resolved, pinned model version: what the job spec carries to the Ray side."""

    name: str
    version: str
    flavor: str
    uri: str
    sha256: str
    signature: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "flavor": self.flavor,
            "uri": self.uri,
            "sha256": self.sha256,
            "signature": self.signature,
        }


def check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise RegistryError(
            f"model {what} {value!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return value


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_digest(files: dict[str, dict[str, Any]]) -> str:
    """One sha256 for a version: over the sorted (path, file sha256) pairs, so renaming, adding or
    changing any file changes it."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\t{files[rel]['sha256']}\n".encode())
    return h.hexdigest()


def hash_tree(root: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "size"}}`` of every file under ``root`` but its manifest.

    A symbolic link is refused, never followed: a link to a copy with the same bytes hashes the same,
    and what it points to can change after the check (log_model's copies are regular files)."""
    out: dict[str, dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        for entry in sorted([*dirnames, *filenames]):
            path = here / entry
            rel = path.relative_to(root).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise TamperedModelError(
                    f"model file {path} is a symbolic link; a model version holds regular files only, never links"
                )
            if stat.S_ISDIR(mode) or rel == MODEL_MANIFEST:
                continue
            if not stat.S_ISREG(mode):
                raise TamperedModelError(f"model file {path} is not a regular file")
            out[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return dict(sorted(out.items()))
