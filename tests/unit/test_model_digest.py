"""A pinned model version is what runs: the digest covers MODEL.json's behavioural fields, a
content-named version's name is its digest, and versions logged in the older files-only format still
verify. Each test edits a real version on disk the way a registry writer could and asserts where it is
refused (the registry's resolve, the runtime's check before Ray, every replica's fetch)."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from airflow_provider_batchinfer.registry import (
    MODEL_MANIFEST,
    REGISTRY_FORMAT,
    ModelVersion,
    RegistryError,
    TamperedModelError,
    fetch_version,
    hash_tree,
    tree_digest,
    verify_local_copy,
)
from tests.models import TextLength, model_job

SIG = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}
MODELS_PY = Path(__file__).resolve().parents[1] / "models.py"


def _manifest(mv: ModelVersion) -> dict:
    return json.loads((Path(mv.uri) / MODEL_MANIFEST).read_text())


def _write(mv: ModelVersion, manifest: dict) -> None:
    (Path(mv.uri) / MODEL_MANIFEST).write_text(json.dumps(manifest, indent=2))


def _reseal(manifest: dict, root: Path) -> None:
    """What a registry writer who knows the digest rule does: re-hash the files and recompute the
    digest (and the per-field record) so that MODEL.json agrees with itself."""
    manifest["files"] = hash_tree(root)
    if "digest" in manifest:
        from airflow_provider_batchinfer.registry.digest import covered_fields, version_digest

        manifest["field_digests"] = covered_fields(manifest)
        manifest["sha256"] = version_digest(manifest)
    else:
        manifest["sha256"] = tree_digest(manifest["files"])


# --- MODEL.json alone, edited -----------------------------------------------------------------------

EDITS = {
    # another class of the same, hashed, models.py: the files are untouched
    "options.class": lambda m: m["options"].update({"class": "SlowLength"}),
    "options.code_dir": lambda m: m["options"].update({"code_dir": "artifact"}),
    "options.trust_pickle": lambda m: m["options"].update({"trust_pickle": True}),
    "flavor": lambda m: m.update({"flavor": "sklearn"}),
    "signature.outputs": lambda m: m["signature"].update({"outputs": {"length": "float64"}}),
}


@pytest.mark.parametrize("field", sorted(EDITS))
def test_editing_only_model_json_is_refused_on_resolve_and_in_the_runtime_naming_the_field(
    registry, text_length_model, tmp_path, field
):
    from airflow_provider_batchinfer.runtime.driver import check_before_ray

    mv = text_length_model
    job = model_job(tmp_path, registry, mv)  # pinned before the edit, as the operator's job file is
    manifest = _manifest(mv)
    EDITS[field](manifest)
    _write(mv, manifest)
    change = (
        "was added after the model was logged" if field == "options.trust_pickle" else "differs from what was logged"
    )
    message = rf"MODEL.json field {field} {change}"
    with pytest.raises(TamperedModelError, match=message):
        registry.get(mv.name, mv.version)  # the operator's resolve
    with pytest.raises(TamperedModelError, match=message):
        verify_local_copy(Path(mv.uri), mv.sha256)
    with pytest.raises(TamperedModelError, match=message):
        fetch_version(mv.uri, mv.sha256)  # every replica, before it loads
    with pytest.raises(TamperedModelError, match=message):
        check_before_ray(job)  # the runtime's driver, before Ray or any input is touched
    assert list((tmp_path / "run").iterdir()) == []


def test_a_resealed_model_json_is_refused_against_the_pinned_digest(registry, text_length_model, tmp_path):
    """A writer who recomputes the digest makes MODEL.json self-consistent; the job's pin is not."""
    mv = text_length_model
    manifest = _manifest(mv)
    manifest["options"]["class"] = "SlowLength"
    _reseal(manifest, Path(mv.uri))
    _write(mv, manifest)
    with pytest.raises(TamperedModelError, match=rf"but {mv.sha256} was pinned"):
        verify_local_copy(Path(mv.uri), mv.sha256)
    with pytest.raises(TamperedModelError, match=rf"but {mv.sha256} was pinned"):
        fetch_version(mv.uri, mv.sha256)


def test_descriptive_fields_are_not_behaviour(registry, text_length_model):
    mv = text_length_model
    manifest = _manifest(mv)
    manifest["description"] = "now with a description"
    manifest["created_at"] = "1999-01-01T00:00:00+00:00"
    _write(mv, manifest)
    assert registry.get(mv.name, mv.version) == mv
    assert verify_local_copy(Path(mv.uri), mv.sha256)["description"] == "now with a description"


def test_same_files_other_class_is_another_digest(registry, text_length_model):
    from tests.models import SlowLength

    slow = registry.log_model("len", "v1", "python", python_class=SlowLength, signature=SIG)
    assert registry.read_manifest("len", "v1")["files"] == registry.read_manifest("text_length", "v1")["files"]
    assert slow.sha256 != text_length_model.sha256


# --- content-named versions ---------------------------------------------------------------------------


def test_a_consistently_rewritten_content_named_version_is_refused(registry, tmp_path):
    mv = registry.log_model("len", None, "python", python_class=TextLength, signature=SIG)
    assert mv.version == f"sha-{mv.sha256[:12]}"
    root = Path(mv.uri)
    code = root / "code" / "models.py"
    code.write_text(code.read_text() + "\n# rewritten\n")
    manifest = _manifest(mv)
    _reseal(manifest, root)
    _write(mv, manifest)
    message = rf"version name {mv.version} is not the digest of its content"
    with pytest.raises(TamperedModelError, match=message):
        registry.get(mv.name, mv.version)
    with pytest.raises(TamperedModelError, match=message):
        verify_local_copy(root)  # nothing pinned but its name
    with pytest.raises(TamperedModelError, match=message):
        fetch_version(mv.uri, manifest["sha256"])  # a replica pinned to the rewritten digest


def test_a_content_name_cannot_be_claimed_by_hand(registry):
    with pytest.raises(RegistryError, match="reserved for content-named versions"):
        registry.log_model("len", "sha-0123456789ab", "python", python_class=TextLength, signature=SIG)


# --- versions logged in the files-only format -----------------------------------------------------------


def write_legacy_version(root: Path, name: str, version: str | None, class_name: str = "TextLength") -> Path:
    """A python version exactly as the files-only format wrote it: the digest over the files alone,
    no digest marker, no per-field record."""
    staging = root / ".staging"
    (staging / "code").mkdir(parents=True)
    shutil.copyfile(MODELS_PY, staging / "code" / "models.py")
    files = hash_tree(staging)
    digest = tree_digest(files)
    version = version if version is not None else f"sha-{digest[:12]}"
    manifest = {
        "format": REGISTRY_FORMAT,
        "name": name,
        "version": version,
        "flavor": "python",
        "signature": SIG,
        "options": {"module": "models", "class": class_name, "code_dir": "code"},
        "files": files,
        "sha256": digest,
        "description": "",
        "created_at": datetime.now(timezone.utc).isoformat(),
    }
    target = root / name / version
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(staging, target)
    (target / MODEL_MANIFEST).write_text(json.dumps(manifest, indent=2))
    return target


@pytest.mark.parametrize("version", ["v1", None])
def test_a_version_logged_in_the_files_only_format_still_resolves_and_loads(registry, version):
    from airflow_provider_batchinfer.runtime.model.flavors import load_predictor

    target = write_legacy_version(Path(registry.root), "len", version)
    mv = registry.get("len", target.name)
    assert mv.sha256 == tree_digest(hash_tree(target))
    assert verify_local_copy(target, mv.sha256)["options"]["class"] == "TextLength"
    path, manifest = fetch_version(mv.uri, mv.sha256)
    predict = load_predictor(path, manifest, "cpu", 1)
    assert list(predict(pa.table({"text": ["ab", "abcd"]}), {})["length"]) == [2, 4]
    # its files are still verified as before: the private copy already made keeps serving the pinned
    # bytes, and a node that copies the changed registry now refuses it
    (target / "code" / "models.py").write_text("# changed\n")
    assert fetch_version(mv.uri, mv.sha256)[0] == path
    with pytest.raises(TamperedModelError, match="code/models.py does not match its recorded sha256"):
        fetch_version(mv.uri, mv.sha256, cache_dir=str(Path(registry.root).parent / "another-node"))


def test_a_downgrade_to_the_files_only_format_does_not_match_the_pin(registry, text_length_model):
    """Dropping the digest marker (so the files-only rule applies) and editing the class: the
    files-only digest is a different number, so the job's pin refuses it; a content name does too."""
    mv = text_length_model
    manifest = _manifest(mv)
    for key in ("digest", "field_digests"):
        manifest.pop(key, None)
    manifest["options"]["class"] = "SlowLength"
    _reseal(manifest, Path(mv.uri))
    _write(mv, manifest)
    with pytest.raises(TamperedModelError, match="was pinned"):
        verify_local_copy(Path(mv.uri), mv.sha256)
    with pytest.raises(TamperedModelError, match="was pinned"):
        fetch_version(mv.uri, mv.sha256)

    auto = registry.log_model("len", None, "python", python_class=TextLength, signature=SIG)
    manifest = _manifest(auto)
    for key in ("digest", "field_digests"):
        manifest.pop(key, None)
    manifest["options"]["class"] = "SlowLength"
    _reseal(manifest, Path(auto.uri))
    _write(auto, manifest)
    with pytest.raises(TamperedModelError, match="is not the digest of its content"):
        registry.get(auto.name, auto.version)


def test_an_unknown_digest_format_is_refused(registry, text_length_model):
    mv = text_length_model
    manifest = _manifest(mv)
    manifest["digest"] = "batchinfer.digest/99"
    _write(mv, manifest)
    with pytest.raises(RegistryError, match="unknown digest format 'batchinfer.digest/99'"):
        registry.get(mv.name, mv.version)


def test_model_json_must_name_the_version_it_is_stored_as(registry, text_length_model):
    from tests.models import SlowLength

    other = registry.log_model("slow", "v1", "python", python_class=SlowLength, signature=SIG)
    shutil.copyfile(Path(other.uri) / MODEL_MANIFEST, Path(text_length_model.uri) / MODEL_MANIFEST)
    with pytest.raises(TamperedModelError, match="names model 'slow' version 'v1' but is stored as text_length/v1"):
        registry.get("text_length", "v1")


def test_a_symlink_in_a_version_is_refused(registry, text_length_model, tmp_path):
    """A link to a copy with the same bytes hashes the same; what it points to can change after the
    check, so a version holds regular files only."""
    code = Path(text_length_model.uri) / "code" / "models.py"
    elsewhere = tmp_path / "elsewhere.py"
    shutil.copyfile(code, elsewhere)
    code.unlink()
    code.symlink_to(elsewhere)
    with pytest.raises(TamperedModelError, match="code/models.py is a symbolic link"):
        verify_local_copy(Path(text_length_model.uri), text_length_model.sha256)
