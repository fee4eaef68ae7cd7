from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_batchinfer.registry import (
    ModelNotFoundError,
    ModelVersionExistsError,
    RegistryError,
    TamperedModelError,
    verify_local_copy,
)
from tests.models import TextLength, model_job, tiny_mlp


def test_log_and_resolve_a_torchscript_model(registry):
    mv = registry.log_model(
        "mlp",
        "v1",
        "torchscript",
        tiny_mlp(),
        signature={"inputs": {f"f{i}": "float32" for i in range(8)}, "outputs": {"score": "float32"}},
    )
    assert mv.uri.endswith("/mlp/v1") and len(mv.sha256) == 64
    manifest = registry.read_manifest("mlp", "v1")
    assert manifest["flavor"] == "torchscript"
    assert set(manifest["files"]) == {"artifact/model.pt"}
    assert list(manifest["signature"]["inputs"]) == [f"f{i}" for i in range(8)]
    assert registry.get("mlp", "v1") == mv
    assert registry.list_versions("mlp") == ["v1"]


def test_versions_are_immutable(registry, tmp_path):
    sig = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
    first = registry.log_model("len", "v1", "python", python_class=TextLength, signature=sig)
    with pytest.raises(ModelVersionExistsError, match=r"already exists .* \(same content; pass if_exists='reuse'"):
        registry.log_model("len", "v1", "python", python_class=TextLength, signature=sig)
    assert registry.log_model("len", "v1", "python", python_class=TextLength, signature=sig, if_exists="reuse") == first
    other = tmp_path / "weights.bin"
    other.write_bytes(b"different")
    with pytest.raises(ModelVersionExistsError, match="versions are immutable"):
        registry.log_model("len", "v1", "python", other, python_class=TextLength, signature=sig, if_exists="reuse")
    # content-addressed versions: same bytes, same version
    auto = registry.log_model("len", None, "python", python_class=TextLength, signature=sig)
    assert auto.version == f"sha-{first.sha256[:12]}"


def test_tampered_added_or_removed_files_are_refused(registry):
    mv = registry.log_model(
        "mlp",
        "v1",
        "torchscript",
        tiny_mlp(),
        signature={"inputs": {"x": "list<float32>"}, "outputs": {"score": "float32"}},
    )
    root = Path(mv.uri)
    verify_local_copy(root, mv.sha256)
    model_file = root / "artifact" / "model.pt"
    original = model_file.read_bytes()
    model_file.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(TamperedModelError, match="artifact/model.pt does not match its recorded sha256"):
        verify_local_copy(root, mv.sha256)
    model_file.write_bytes(original)
    (root / "artifact" / "extra.py").write_text("print('x')")
    with pytest.raises(TamperedModelError, match="extra.py was added after the model was logged"):
        verify_local_copy(root, mv.sha256)
    (root / "artifact" / "extra.py").unlink()
    with pytest.raises(TamperedModelError, match="has sha256 .* but 0000 was pinned"):
        verify_local_copy(root, "0000")


def test_unknown_models_and_bad_names_say_what_exists(registry):
    registry.log_model("len", "v1", "python", python_class=TextLength)
    with pytest.raises(ModelNotFoundError, match="known versions of 'len': v1"):
        registry.get("len", "v9")
    with pytest.raises(ModelNotFoundError, match="known models: len"):
        registry.get("nope", "v1")
    with pytest.raises(RegistryError, match="model version '../x' is not allowed"):
        registry.get("len", "../x")
    with pytest.raises(RegistryError, match="unknown flavor 'keras'"):
        registry.log_model("m", "v1", "keras", "x")
    with pytest.raises(RegistryError, match="flavor .torchscript. needs a signature"):
        registry.log_model("m", "v1", "torchscript", tiny_mlp())


def test_a_signature_keeps_the_feature_order_the_model_was_fitted_in(registry, tmp_path):
    """A torchscript model stacks its inputs in signature order: f10 must stay after f9, in the
    registry's MODEL.json and through the job file the runtime reads (both were once written with
    sorted keys, which put f10 before f2 and silently fed the model the wrong columns)."""
    from airflow_provider_batchinfer.contract import JobFile

    features = [f"f{i}" for i in range(12)]
    mv = registry.log_model(
        "mlp12",
        "v1",
        "torchscript",
        tiny_mlp(12),
        signature={"inputs": dict.fromkeys(features, "float32"), "outputs": {"score": "float32"}},
    )
    assert list(registry.read_manifest("mlp12", "v1")["signature"]["inputs"]) == features
    assert list(registry.get("mlp12", "v1").signature["inputs"]) == features
    job = model_job(tmp_path, registry, mv)
    assert list(JobFile.from_json(job.to_json()).model.signature["inputs"]) == features
