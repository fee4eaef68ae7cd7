"""A Python model's logged code stays exactly what was hashed when it is loaded with bytecode on.

Python writes ``__pycache__`` beside a module it imports unless told not to (most machines; this one
sets PYTHONDONTWRITEBYTECODE). A cache written into the version's ``code/`` directory is a file added
after the model was logged, and the next job's check refuses it as tampering."""

from __future__ import annotations

import sys

import pyarrow as pa

from airflow_provider_batchinfer.registry import ModelRegistry, verify_local_copy
from airflow_provider_batchinfer.runtime.model.flavors import python_class
from tests.models import TextLength


def test_loading_a_python_model_writes_no_bytecode_beside_its_logged_code(tmp_path, monkeypatch):
    registry = ModelRegistry(str(tmp_path / "registry"))
    sig = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
    mv = registry.log_model("bytecode_length", "v1", "python", python_class=TextLength, signature=sig)
    local = registry.local_copy("bytecode_length", "v1")
    manifest = verify_local_copy(local, mv.sha256)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as on a machine without PYTHONDONTWRITEBYTECODE
    monkeypatch.syspath_prepend(str(tmp_path))  # sys.path is restored; the module name is popped below
    module = manifest["options"]["module"]
    monkeypatch.delitem(sys.modules, module, raising=False)  # imported from the version, not the test's copy
    predict = python_class.load(local, manifest, "cpu", 1)
    assert predict(pa.table({"text": ["ab", "abcd"]}), {})["length"].tolist() == [2, 4]
    assert sys.dont_write_bytecode is False  # restored after the import
    assert not list(local.rglob("__pycache__")), sorted(p.name for p in local.rglob("*"))
    verify_local_copy(local, mv.sha256)  # the next job's check passes
    sys.modules.pop(module, None)
