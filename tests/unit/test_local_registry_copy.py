"""A local registry's version is loaded from a verified private copy, never from the registry path
it was hashed at: a writer who swaps a file there after the hash changes nothing that runs."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from airflow_provider_batchinfer.registry import ModelRegistry, TamperedModelError, fetch_version, verify_local_copy
from airflow_provider_batchinfer.runtime.model.flavors import load_predictor

SIG = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
HONEST = """class Length:
    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch):
        return {"length": batch["text"].str.len().to_numpy()}
"""
# the same number of bytes: a listing (names and sizes) sees no change
SWAPPED = HONEST.replace('batch["text"].str.len()', 'batch["text"].str.len()*9').replace(
    "    @classmethod", "  @classmethod"
)


def _logged(tmp_path: Path, module: str):
    assert len(SWAPPED) == len(HONEST)
    code = tmp_path / "src" / f"{module}.py"
    code.parent.mkdir()
    code.write_text(HONEST)
    registry = ModelRegistry(str(tmp_path / "registry"))
    mv = registry.log_model(
        "length", "v1", "python", python_class=f"{module}:Length", code_paths=[str(code)], signature=SIG
    )
    return registry, mv, Path(mv.uri) / "code" / f"{module}.py"


def _lengths(path: Path, manifest: dict, module: str) -> list[int]:
    sys.modules.pop(module, None)
    try:
        return load_predictor(path, manifest, "cpu", 1)(pa.table({"text": ["ab", "abcd"]}), {})["length"].tolist()
    finally:
        sys.modules.pop(module, None)


def test_a_swap_after_the_hash_does_not_reach_the_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(tmp_path / "cache"))
    registry, mv, code = _logged(tmp_path, "swap_after_hash")
    path, manifest = fetch_version(mv.uri, mv.sha256)  # hashed: what a replica does before it loads
    assert manifest is not None and not path.is_relative_to(Path(registry.root))
    assert path.is_relative_to(tmp_path / "cache") and stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700
    code.write_text(SWAPPED)  # between the hash and the load
    assert _lengths(path, manifest, "swap_after_hash") == [2, 4]  # the bytes that were hashed ran


def test_a_swap_before_the_copy_is_refused_and_nothing_is_published(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(tmp_path / "cache"))
    _registry, mv, code = _logged(tmp_path, "swap_before_copy")
    verify_local_copy(Path(mv.uri), mv.sha256)  # the driver's check passed
    code.write_text(SWAPPED)  # then a writer swaps the code before a replica copies the version
    with pytest.raises(
        TamperedModelError, match=r"swap_before_copy.py does not match its recorded sha256.*copied just now"
    ):
        fetch_version(mv.uri, mv.sha256)
    published = list((tmp_path / "cache").rglob("MODEL.json"))
    assert published == []  # no copy left where a loader would look


def test_a_link_in_a_local_version_is_refused_never_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(tmp_path / "cache"))
    _registry, mv, code = _logged(tmp_path, "linked_code")
    (tmp_path / "elsewhere.py").write_text(HONEST)
    code.unlink()
    code.symlink_to(tmp_path / "elsewhere.py")  # the same bytes, through a link that can change later
    with pytest.raises(TamperedModelError, match=r"linked_code.py is a symbolic link"):
        fetch_version(mv.uri, mv.sha256)
