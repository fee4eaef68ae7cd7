"""Old import paths of moved modules: the same module object as the new path, with a warning that
names the new path and points at the importing line."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from airflow_provider_batchinfer import _moved

PACKAGE = Path(_moved.__file__).parent


def _forget(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Import ``names`` afresh in this test: an old path is answered once per interpreter."""
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("s3", "store.s3"),
        ("rundir", "store.commit.rundir"),
        ("specs", "contract.specs"),
        ("tables.catalog", "store.iceberg.catalog"),
        ("runtime.io", "runtime.output.parts"),
        ("runtime.flavors.optimized_text", "runtime.model.flavors.optimized.optimized_text"),
        ("launchers.embedded_ray", "launchers.embedded.embedded_ray"),
        ("operators.job_file", "operators.build_job"),
    ],
)
def test_an_old_path_is_the_new_module_and_warns(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    old_name, new_name = f"airflow_provider_batchinfer.{old}", f"airflow_provider_batchinfer.{new}"
    _forget(monkeypatch, old_name)
    # imported first: a module that imports Airflow would otherwise install Airflow's own warnings
    # hook (the warning then goes to its log) while the old path is being answered
    new_module = importlib.import_module(new_name)
    with pytest.warns(DeprecationWarning, match=rf"{old_name} moved to {new_name}; import it from there") as seen:
        module = importlib.import_module(old_name)
    assert module is new_module
    assert module.__name__ == new_name
    assert module.__spec__ is not None and module.__spec__.name == new_name
    assert seen[0].filename == __file__


def test_names_imported_from_an_old_path_are_the_same_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, "airflow_provider_batchinfer.specs", "airflow_provider_batchinfer.specs.job")
    with pytest.warns(DeprecationWarning) as seen:
        from airflow_provider_batchinfer.specs import JobSpec
        from airflow_provider_batchinfer.specs.job import JobSpec as JobSpecFromModule
    from airflow_provider_batchinfer.contract.specs import JobSpec as NewJobSpec

    assert JobSpec is NewJobSpec is JobSpecFromModule
    assert {w.filename for w in seen} == {__file__}


def test_names_that_left_their_module_are_found_from_its_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stage`` lent the marker readers, the layout names and the location helpers; ``markers`` the
    readers of a committed run: each is found from the old path, where it lives now, with a warning
    naming that place; the module's own names are the new module's."""
    _forget(monkeypatch, "airflow_provider_batchinfer.stage", "airflow_provider_batchinfer.markers")
    with pytest.warns(DeprecationWarning) as seen:
        from airflow_provider_batchinfer.markers import read_valid_manifest, validate_manifest
        from airflow_provider_batchinfer.stage import SUCCESS_MARKER, Stage, StageError, committed_files
    from airflow_provider_batchinfer import contract
    from airflow_provider_batchinfer.store import committed, locations, stage
    from airflow_provider_batchinfer.store.commit import markers

    assert read_valid_manifest is committed.read_valid_manifest and validate_manifest is markers.validate_manifest
    assert committed_files is markers.committed_files and SUCCESS_MARKER == contract.SUCCESS_MARKER
    assert Stage is stage.Stage and StageError is locations.StageError
    said = [str(w.message) for w in seen]
    assert (
        "airflow_provider_batchinfer.stage.committed_files moved to airflow_provider_batchinfer.store.commit.markers; "
        "import it from there (the old path goes in the next release)"
    ) in said
    assert any(m.startswith("airflow_provider_batchinfer.markers.read_valid_manifest moved to ") for m in said)
    assert {w.filename for w in seen} == {__file__}
    with pytest.raises(ImportError, match="nothing_here"):
        from airflow_provider_batchinfer.stage import nothing_here  # noqa: F401


def test_every_old_path_leads_to_a_module_and_no_file_is_left_at_it() -> None:
    for old, new in _moved.MOVED.items():
        assert not (PACKAGE / f"{old.replace('.', '/')}.py").exists(), old
        assert not (PACKAGE / old.replace(".", "/") / "__init__.py").exists(), old
        importlib.import_module(f"airflow_provider_batchinfer.{new}")
    for old, names in _moved.MOVED_NAMES.items():
        assert old in _moved.MOVED, old
        for name, new in names.items():
            assert hasattr(importlib.import_module(f"airflow_provider_batchinfer.{new}"), name), (old, name)


def test_paths_that_did_not_move_import_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    # the operator's class path and the trigger classpaths stored in the metadata DB
    for path in (
        "airflow_provider_batchinfer.operators.batch_inference.BatchInferenceOperator",
        "airflow_provider_batchinfer.triggers.success_marker.SuccessMarkerTrigger",
        "airflow_provider_batchinfer.triggers.ray_job.RayJobTrigger",
    ):
        module, _, name = path.rpartition(".")
        assert getattr(importlib.import_module(module), name).__module__ == module
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message)]


def test_a_name_that_never_existed_still_fails() -> None:
    with pytest.raises(ModuleNotFoundError, match="airflow_provider_batchinfer.nowhere"):
        importlib.import_module("airflow_provider_batchinfer.nowhere")
