"""A python model logged as ``"pkg:Class"`` without ``code_paths`` runs code no digest covers: the
job says so in its log (the driver's check and each replica's load) and records it in the
``_SUCCESS`` manifest. No Ray: the checks before it, the flavor's load, the manifest's schema."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from airflow_provider_batchinfer.contract import Manifest, ManifestError
from airflow_provider_batchinfer.registry import fetch_version
from airflow_provider_batchinfer.runtime import driver
from airflow_provider_batchinfer.runtime.model.flavors import python_class
from airflow_provider_batchinfer.runtime.model.flavors.python_class import unhashed_imports
from tests.models import TextLength, ticket_job
from tests.runs import committed_run

SIG = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}


def test_an_unhashed_import_is_named_in_the_log_and_the_manifest(tmp_path, registry, capsys):
    (tmp_path / "weights.txt").write_text("a model's own files are hashed; its imported class is not\n")
    mv = registry.log_model(
        "installed_length",
        "v1",
        "python",
        str(tmp_path / "weights.txt"),
        python_class="tests.models:TextLength",
        signature=SIG,
    )
    _, job = ticket_job(tmp_path, registry, mv, "unhashed", rows=12)
    checked = driver.check_before_ray(job)  # the driver, before Ray: its log line and the manifest's field
    message = (
        "model installed_length/v1 imports tests.models:TextLength from the worker's installed packages, not "
        "from code logged with the version: its sha256 does not cover that code"
    )
    assert message in capsys.readouterr().out
    assert checked.unhashed_imports == ("tests.models:TextLength",)
    path, model_manifest = fetch_version(mv.uri, mv.sha256)  # a replica: its load names the file imported
    predict = python_class.load(path, model_manifest, "cpu", 1)
    assert predict(pa.table({"text": ["ab"]}), {})["length"].tolist() == [2]
    assert f"{message}. Log it with code_paths" in (out := capsys.readouterr().out)
    assert f"(imported from {Path(sys.modules['tests.models'].__file__)})" in out
    # what the driver hands the commit (runtime/driver.py: build_manifest(..., unhashed_imports=...))
    written = committed_run(tmp_path / "run")
    recorded = dataclasses.replace(written, unhashed_imports=checked.unhashed_imports)
    assert json.loads(recorded.to_json())["unhashed_imports"] == ["tests.models:TextLength"]


def test_a_model_whose_code_was_logged_records_no_unhashed_import(tmp_path, registry, capsys):
    mv = registry.log_model("logged_length", "v1", "python", python_class=TextLength, signature=SIG)
    _, job = ticket_job(tmp_path, registry, mv, "hashed", rows=4)
    assert driver.check_before_ray(job).unhashed_imports == ()  # what the manifest records
    assert "installed packages" not in capsys.readouterr().out


def test_unhashed_imports_reads_the_version_record():
    files = {"code/models.py": {"sha256": "0" * 64}}
    logged = {"flavor": "python", "options": {"module": "models", "class": "A", "code_dir": "code"}, "files": files}
    assert unhashed_imports(logged) == ()
    package = {**logged, "options": {"module": "pkg.sub", "class": "B", "code_dir": "code"}}
    assert unhashed_imports({**package, "files": {"code/pkg/sub.py": {"sha256": "0" * 64}}}) == ()
    assert unhashed_imports(package) == ("pkg.sub:B",)  # code/ holds models.py, not pkg
    assert unhashed_imports({**logged, "flavor": "torchscript"}) == ()


def test_a_manifest_without_the_field_still_reads_and_a_bad_one_is_refused(tmp_path):
    data = committed_run(tmp_path).to_dict()
    assert "unhashed_imports" not in data and Manifest.from_dict(data).unhashed_imports == ()
    assert Manifest.from_dict({**data, "unhashed_imports": ["pkg:Cls"]}).unhashed_imports == ("pkg:Cls",)
    with pytest.raises(ManifestError, match="unhashed_imports must be a list of strings"):
        Manifest.from_dict({**data, "unhashed_imports": "pkg:Cls"})
