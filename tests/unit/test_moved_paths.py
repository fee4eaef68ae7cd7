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
        ("stage", "store.stage"),
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
    with pytest.warns(DeprecationWarning, match=rf"{old_name} moved to {new_name}; import it from there") as seen:
        module = importlib.import_module(old_name)
    assert module is importlib.import_module(new_name)
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


def test_every_old_path_leads_to_a_module_and_no_file_is_left_at_it() -> None:
    for old, new in _moved.MOVED.items():
        assert not (PACKAGE / f"{old.replace('.', '/')}.py").exists(), old
        assert not (PACKAGE / old.replace(".", "/") / "__init__.py").exists(), old
        importlib.import_module(f"airflow_provider_batchinfer.{new}")


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
