"""ModelRegistry: log, list, resolve and check versions under one registry root."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.registry.artifacts import _python_class_source, _stage_pretrained, normalize_signature
from airflow_provider_batchinfer.registry.digest import (
    CONTENT_NAME,
    DIGEST_KEY,
    check_version,
    content_name,
    covered_fields,
    seal,
)
from airflow_provider_batchinfer.registry.fetch import (
    fetch_version,
)
from airflow_provider_batchinfer.registry.mlflow_import import stage_mlflow_model
from airflow_provider_batchinfer.registry.pipelines import PIPELINE_FLAVOR, pipeline_signature, stage_pipeline
from airflow_provider_batchinfer.registry.tabular import TABULAR_FLAVORS, stage_tabular
from airflow_provider_batchinfer.registry.versions import (
    FLAVORS,
    MODEL_MANIFEST,
    PRETRAINED_FLAVORS,
    REGISTRY_FORMAT,
    ModelNotFoundError,
    ModelVersion,
    ModelVersionExistsError,
    RegistryError,
    TamperedModelError,
    check_name,
    hash_tree,
)
from airflow_provider_batchinfer.store.commit.rundir import clear_run_directory
from airflow_provider_batchinfer.store.locations import join
from airflow_provider_batchinfer.store.stage import Stage

_log = logging.getLogger(__name__)


class ModelRegistry:
    """Log, list, resolve and verify model versions under one root location."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = root.rstrip("/")
        self.storage_options = storage_options

    def _stage(self, *parts: str) -> Stage:
        return Stage.open(join(self.root, *parts), self.storage_options)

    # --- reading -----------------------------------------------------------------------------------
    def list_versions(self, name: str) -> list[str]:
        check_name(name, "name")
        files = self._stage(name).list_files(recursive=True)
        return sorted({rel.split("/")[0] for rel, _ in files if rel.endswith("/" + MODEL_MANIFEST)})

    def list_models(self) -> list[str]:
        files = Stage.open(self.root, self.storage_options).list_files(recursive=True)
        return sorted({rel.split("/")[0] for rel, _ in files if rel.count("/") == 2 and rel.endswith(MODEL_MANIFEST)})

    def read_manifest(self, name: str, version: str) -> dict[str, Any]:
        check_name(name, "name")
        check_name(version, "version")
        marker = self._stage(name, version, MODEL_MANIFEST)
        if not marker.exists():
            known = self.list_versions(name)
            if known:
                hint = f"known versions of {name!r}: {', '.join(known)}"
            else:
                models = self.list_models()
                hint = (
                    f"known models: {', '.join(models) if models else 'none'}; log it with ModelServiceHook.log_model"
                )
            raise ModelNotFoundError(
                f"model {name!r} version {version!r} is not in the registry at {self.root} ({hint})"
            )
        manifest = marker.read_json()
        if not isinstance(manifest, dict) or manifest.get("format") != REGISTRY_FORMAT:
            raise RegistryError(f"{marker.location} is not a {REGISTRY_FORMAT} manifest")
        # every resolve: the manifest agrees with its digest (fields and recorded file hashes, nothing
        # downloaded), names this location, and a content name is its digest
        check_version(manifest, self._stage(name, version).location, name=name, version=version)
        if manifest.get(DIGEST_KEY) is None:
            _log.warning(
                "model %s/%s was logged before MODEL.json's fields were covered by its digest: its files are "
                "verified, its flavor, options and signature are not; log it again to cover them",
                name,
                version,
            )
        return manifest

    def get(self, name: str, version: str) -> ModelVersion:
        m = self.read_manifest(name, version)
        return ModelVersion(
            name=name,
            version=version,
            flavor=m["flavor"],
            uri=join(self.root, name, version),
            sha256=m["sha256"],
            signature=m["signature"],
        )

    # --- writing -----------------------------------------------------------------------------------
    def log_model(
        self,
        name: str,
        version: str | None,
        flavor: str,
        artifact: Any = None,
        *,
        signature: dict[str, Any] | None = None,
        python_class: Any = None,
        code_paths: list[str] | None = None,
        description: str = "",
        if_exists: str = "error",
        **flavor_options: Any,  # a flavor's own settings (sklearn method=, trust_pickle=, ...)
    ) -> ModelVersion:
        """Write a new immutable version and return it.

        ``artifact``: a TorchScript module or ``.pt`` file (``torchscript``), a SentenceTransformer or
        its saved directory (``sentence_transformers``), or any file/directory handed to
        ``python_class.load(path)`` (``python``). ``version=None`` names the version after its content
        (``sha-<12 hex>``), so logging the same bytes twice yields the same version.
        ``if_exists="reuse"`` returns an existing version when its content is identical; a
        different content under an existing version is always refused. ``sklearn``, ``xgboost``,
        ``lightgbm`` and ``onnx`` models take a fitted model or its file and their own settings as
        keywords (``registry/tabular.py``; docs/models.md).

        ``flavor="mlflow"``: ``artifact`` is an MLflow model URI (``models:/<name>/<version>``,
        ``models:/<name>@<alias>``, ``runs:/<run id>/<path>``), copied and hashed; see
        ``registry/mlflow_import.py`` for its options. ``transformers_pipeline`` takes ``task=``.
        """
        check_name(name, "name")
        if flavor == "mlflow":  # resolved to a native flavor or mlflow_pyfunc there
            with tempfile.TemporaryDirectory(prefix="batchinfer-mlflow-") as tmp:
                staged = stage_mlflow_model(artifact, Path(tmp), signature=signature, **flavor_options)
                return self.commit_staged(
                    name,
                    version,
                    staged.flavor,
                    staged.signature,
                    staged.options,
                    staged.directory,
                    description,
                    if_exists,
                    extra={"mlflow": staged.origin},
                )
        if flavor == "mlflow_pyfunc":
            raise RegistryError(
                "an mlflow_pyfunc version is logged from MLflow: flavor='mlflow', artifact='models:/...'"
            )
        if flavor not in FLAVORS:
            raise RegistryError(f"unknown flavor {flavor!r}; supported flavors: {', '.join(FLAVORS)}")
        if if_exists not in ("error", "reuse"):
            raise RegistryError(f"if_exists must be 'error' or 'reuse', got {if_exists!r}")
        if flavor not in TABULAR_FLAVORS:  # tabular flavors check their own settings (registry/tabular.py)
            unknown = sorted(set(flavor_options) - ({"task"} if flavor == PIPELINE_FLAVOR else set()))
            if unknown:
                raise RegistryError(f"log_model got unexpected options {unknown} for flavor {flavor!r}")
        read_from_model = (*TABULAR_FLAVORS, PIPELINE_FLAVOR)  # signatures inferred from the model or task
        sig = normalize_signature(signature, flavor) if flavor not in read_from_model else {}
        with tempfile.TemporaryDirectory(prefix="batchinfer-log-") as tmp:
            staging = Path(tmp)
            if flavor in TABULAR_FLAVORS:  # stored in a safe format, signature read from the model
                options, sig = stage_tabular(staging / "artifact", flavor, artifact, signature, flavor_options)
            elif flavor == PIPELINE_FLAVOR:  # the signature follows from the task
                options = stage_pipeline(staging / "artifact", artifact, flavor_options.get("task"))
                sig = pipeline_signature(options["task"], signature)
            else:
                options = self._stage_artifact(staging, flavor, artifact, python_class, code_paths)
            return self.commit_staged(name, version, flavor, sig, options, staging, description, if_exists)

    def commit_staged(
        self,
        name: str,
        version: str | None,
        flavor: str,
        sig: dict[str, Any],
        options: dict[str, Any],
        staging: Path,
        description: str = "",
        if_exists: str = "error",
        extra: dict[str, Any] | None = None,
    ) -> ModelVersion:
        """Hash every file under ``staging`` and write them as version ``version`` (manifest last).

        ``extra``: more manifest sections (an imported model's origin, e.g. ``{"mlflow": {...}}``)."""
        check_name(name, "name")
        if if_exists not in ("error", "reuse"):
            raise RegistryError(f"if_exists must be 'error' or 'reuse', got {if_exists!r}")
        files = hash_tree(staging)
        if not files:
            raise RegistryError(f"model {name!r}: the artifact holds no files")
        if version is not None and CONTENT_NAME.match(version):
            raise RegistryError(
                f"model version {version!r} is not allowed: names sha-<12 hex> are reserved for content-named "
                "versions; pass version=None to name the version after its digest"
            )
        manifest = seal(
            {
                "format": REGISTRY_FORMAT,
                "name": name,
                "version": version,  # not in the digest: a content name is made from it
                "flavor": flavor,
                "signature": sig,
                "options": options,
                "files": files,
                "description": description,
                "created_at": datetime.now(timezone.utc).isoformat(),
                **(extra or {}),
            }
        )
        digest = manifest["sha256"]
        version = version if version is not None else content_name(digest)
        check_name(version, "version")
        manifest["version"] = version
        target = self._stage(name, version)
        marker = target.child(MODEL_MANIFEST)
        if marker.exists():
            existing = marker.read_json()
            if if_exists == "reuse" and _same_content(existing, manifest):
                return self.get(name, version)
            same = " (same content; pass if_exists='reuse' to use it)" if _same_content(existing, manifest) else ""
            raise ModelVersionExistsError(
                f"model {name!r} version {version!r} already exists at {target.location}{same}; versions are "
                "immutable: log the new model under a new version"
            )
        if target.exists():
            clear_run_directory(target)  # leftovers of a log that died before its manifest
        for rel in files:
            src = staging / rel
            target.child(*rel.split("/")).write_bytes(src.read_bytes())
        marker.write_json(manifest)
        return self.get(name, version)

    @staticmethod
    def _stage_artifact(
        staging: Path, flavor: str, artifact: Any, python_class: Any, code_paths: list[str] | None
    ) -> dict[str, Any]:
        art = staging / "artifact"
        options: dict[str, Any] = {}
        if flavor == "torchscript":
            if artifact is None:
                raise RegistryError("a torchscript model needs artifact=<ScriptModule or path to a .pt file>")
            art.mkdir()
            if isinstance(artifact, (str, os.PathLike)):
                shutil.copyfile(artifact, art / "model.pt")
            else:
                import torch

                if not isinstance(artifact, torch.jit.ScriptModule):
                    raise RegistryError(
                        f"a torchscript artifact must be a torch.jit.ScriptModule (torch.jit.script(model)) or a "
                        f"path, got {type(artifact).__name__}"
                    )
                torch.jit.save(artifact, str(art / "model.pt"))
            options["file"] = "artifact/model.pt"
        elif flavor == "sentence_transformers":
            if artifact is None:
                raise RegistryError(
                    "a sentence_transformers model needs artifact=<SentenceTransformer or its directory>"
                )
            if isinstance(artifact, (str, os.PathLike)):
                if not Path(artifact).is_dir():
                    raise RegistryError(f"sentence_transformers artifact {artifact!s} is not a directory")
                shutil.copytree(artifact, art, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                artifact.save(str(art))
            options["dir"] = "artifact"
        elif flavor in PRETRAINED_FLAVORS:
            _stage_pretrained(art, flavor, artifact)
            options["dir"] = "artifact"
        elif flavor == "python":
            if python_class is None:
                raise RegistryError("a python model needs python_class=<class with load(path) and predict(batch)>")
            module, qualname, paths = _python_class_source(python_class, code_paths)
            code = staging / "code"
            code.mkdir()
            for p in paths:
                src = Path(p)
                if src.is_dir():
                    shutil.copytree(src, code / src.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                elif src.is_file():
                    shutil.copyfile(src, code / src.name)
                else:
                    raise RegistryError(f"code path {p} does not exist")
            options.update({"module": module, "class": qualname, "code_dir": "code"})
            if artifact is not None:
                src = Path(artifact)
                if src.is_dir():
                    shutil.copytree(src, art)
                elif src.is_file():
                    art.mkdir()
                    shutil.copyfile(src, art / src.name)
                    options["artifact_file"] = src.name
                else:
                    raise RegistryError(f"python model artifact {artifact} does not exist")
                options["artifact"] = "artifact"
        return options

    # --- verification --------------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        import pyarrow.fs as pafs

        return isinstance(Stage.open(self.root, self.storage_options).fs, pafs.LocalFileSystem)

    def local_copy(self, name: str, version: str, cache_dir: str | None = None) -> Path:
        """A local directory holding the version's files, for checks and inspection: the registry
        itself when it is local, else a node-local cache keyed by content hash and location (see
        :func:`fetch_version`). Not verified, and never what a loader reads: loaders take
        :func:`fetch_version`'s verified private copy."""
        check_name(name, "name")
        check_name(version, "version")
        if self.is_local:
            return Path(self._stage(name, version).path)
        sha256 = self.read_manifest(name, version)["sha256"]
        return fetch_version(join(self.root, name, version), sha256, self.storage_options, cache_dir, verify=False)[0]

    def check_listing(self, name: str, version: str, expected_sha256: str | None = None) -> dict[str, Any]:
        """Check a remote version without downloading it: every file its manifest records is there
        with its recorded size, nothing was added, and the manifest's digest matches its per-file
        hashes and the pinned one. What no listing can see (same-size content changes) is caught
        where the files are read: every Ray actor re-hashes its copy before loading it.

        This is how the Airflow side vets an object-store model: a multi-GB model is never pulled
        onto an Airflow worker just to be hashed."""
        manifest = self.read_manifest(name, version)
        where = self._stage(name, version)
        present = {rel: size for rel, size in where.list_files() if rel != MODEL_MANIFEST}
        recorded = manifest["files"]
        for rel in sorted(set(recorded) | set(present)):
            if rel not in present:
                raise TamperedModelError(
                    f"model file {where.location}/{rel} was removed after the model was logged; re-log the model"
                )
            if rel not in recorded:
                raise TamperedModelError(
                    f"model file {where.location}/{rel} was added after the model was logged; re-log the model"
                )
            if present[rel] != recorded[rel].get("size"):
                raise TamperedModelError(
                    f"model file {where.location}/{rel} is {present[rel]} bytes but was {recorded[rel].get('size')} when "
                    "logged: it changed after the model was logged; refusing to use it"
                )
        check_version(manifest, where.location, name=name, version=version, expected_sha256=expected_sha256)
        return manifest


def _same_content(existing: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a version already logged holds what ``new`` would: the same digest, or, for one
    logged in the files-only format, the same files and the same covered fields."""
    if existing.get("sha256") == new["sha256"]:
        return True
    if existing.get(DIGEST_KEY) is not None or not isinstance(existing.get("files"), dict):
        return False
    same_files = {rel: e.get("sha256") for rel, e in existing["files"].items() if isinstance(e, dict)} == {
        rel: e["sha256"] for rel, e in new["files"].items()
    }
    return same_files and covered_fields(existing) == covered_fields({k: v for k, v in new.items() if k != DIGEST_KEY})
