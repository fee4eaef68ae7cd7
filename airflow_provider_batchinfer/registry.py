"""A versioned, immutable model registry on a stage.

Layout: ``<registry>/<name>/<version>/MODEL.json`` (the manifest, written last) beside the files it
hashes (``artifact/...`` and, for the Python flavor, ``code/...``). A version is immutable: logging
it again is refused unless the content is byte-identical (``if_exists="reuse"``), and loading it
re-hashes every file, so a model that changed after it was logged is never used. Both sides use
this module (the operator resolves versions, every Ray worker verifies before loading), so it
imports neither Airflow nor Ray.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.stage import Stage, StageError, join

MODEL_MANIFEST = "MODEL.json"
REGISTRY_FORMAT = "batchinfer.model/1"
FLAVORS = ("torchscript", "sentence_transformers", "python", "text_generation", "image_classification")
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
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            if rel == MODEL_MANIFEST:
                continue
            out[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return out


def normalize_signature(signature: dict[str, Any] | None, flavor: str) -> dict[str, Any]:
    """``{"inputs": {col: dtype}, "outputs": {col: dtype}}``, ordered: the order of inputs is the
    order a tabular model stacks its features in."""
    defaults: dict[str, dict[str, Any]] = {
        "sentence_transformers": {"inputs": {"text": "string"}, "outputs": {"embedding": "list<float32>"}},
        "python": {"inputs": {}, "outputs": {}},
        # messages: OpenAI chat messages (list of structs or JSON); sampling_params: optional per-row overrides
        "text_generation": {
            "inputs": {"messages": "messages", "sampling_params": "optional"},
            "outputs": {"choices": "list<struct>", "usage": "struct"},
        },
        "image_classification": {"inputs": {"image": "binary"}, "outputs": {"label": "string", "score": "float32"}},
    }
    if signature is None:
        if flavor not in defaults:
            raise RegistryError(
                f"flavor {flavor!r} needs a signature: {{'inputs': {{column: dtype, ...}}, 'outputs': {{column: dtype}}}}"
            )
        signature = defaults[flavor]
    if not isinstance(signature, dict) or set(signature) - {"inputs", "outputs"}:
        raise RegistryError("signature must be a dict with 'inputs' and 'outputs', each {column: dtype}")
    result = {}
    for key in ("inputs", "outputs"):
        cols = signature.get(key, {})
        if not isinstance(cols, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in cols.items()):
            raise RegistryError(f"signature[{key!r}] must be a dict of {{column name: dtype string}}, got {cols!r}")
        result[key] = dict(cols)
    if flavor == "torchscript" and not result["inputs"]:
        raise RegistryError("a torchscript model's signature must name its input columns, in feature order")
    if flavor == "torchscript" and not result["outputs"]:
        raise RegistryError("a torchscript model's signature must name its output column(s)")
    return result


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
        if manifest.get("format") != REGISTRY_FORMAT:
            raise RegistryError(f"{marker.location} is not a {REGISTRY_FORMAT} manifest")
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
    ) -> ModelVersion:
        """Write a new immutable version and return it.

        ``artifact``: a TorchScript module or ``.pt`` file (``torchscript``), a SentenceTransformer or
        its saved directory (``sentence_transformers``), or any file/directory handed to
        ``python_class.load(path)`` (``python``). ``version=None`` names the version after its content
        (``sha-<12 hex>``), so logging the same bytes twice yields the same version.
        ``if_exists="reuse"`` returns an existing version when its content is identical; a
        different content under an existing version is always refused.
        """
        check_name(name, "name")
        if flavor not in FLAVORS:
            raise RegistryError(f"unknown flavor {flavor!r}; supported flavors: {', '.join(FLAVORS)}")
        if if_exists not in ("error", "reuse"):
            raise RegistryError(f"if_exists must be 'error' or 'reuse', got {if_exists!r}")
        sig = normalize_signature(signature, flavor)
        with tempfile.TemporaryDirectory(prefix="batchinfer-log-") as tmp:
            staging = Path(tmp)
            options = self._stage_artifact(staging, flavor, artifact, python_class, code_paths)
            files = hash_tree(staging)
            if not files:
                raise RegistryError(f"model {name!r}: the artifact holds no files")
            digest = tree_digest(files)
            version = version if version is not None else f"sha-{digest[:12]}"
            check_name(version, "version")
            manifest = {
                "format": REGISTRY_FORMAT,
                "name": name,
                "version": version,
                "flavor": flavor,
                "signature": sig,
                "options": options,
                "files": files,
                "sha256": digest,
                "description": description,
                "created_at": datetime.now(timezone.utc).isoformat(),
            }
            target = self._stage(name, version)
            marker = target.child(MODEL_MANIFEST)
            if marker.exists():
                existing = marker.read_json()
                if if_exists == "reuse" and existing.get("sha256") == digest:
                    return self.get(name, version)
                same = " (same content; pass if_exists='reuse' to use it)" if existing.get("sha256") == digest else ""
                raise ModelVersionExistsError(
                    f"model {name!r} version {version!r} already exists at {target.location}{same}; versions are "
                    "immutable: log the new model under a new version"
                )
            if target.exists():
                target.clear_run_directory()  # leftovers of a log that died before its manifest
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
        """A local directory holding the version's files: the registry itself when it is local, else
        a node-local cache keyed by content hash (see :func:`fetch_version`). Not verified."""
        check_name(name, "name")
        check_name(version, "version")
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
            if present[rel] != recorded[rel]["size"]:
                raise TamperedModelError(
                    f"model file {where.location}/{rel} is {present[rel]} bytes but was {recorded[rel]['size']} when "
                    "logged: it changed after the model was logged; refusing to use it"
                )
        digest = tree_digest(recorded)
        if digest != manifest["sha256"] or (expected_sha256 and digest != expected_sha256):
            raise TamperedModelError(
                f"model at {where.location}: its {MODEL_MANIFEST} was edited (digest {digest[:12]}… "
                f"but {expected_sha256 or manifest['sha256']} was pinned); refusing to use it"
            )
        return manifest


MODEL_CACHE_ENV = "BATCHINFER_MODEL_CACHE"


def model_cache_dir(cache_dir: str | None = None) -> Path:
    """Where object-store models are cached on this node: ``$BATCHINFER_MODEL_CACHE``, else
    ``<tmp>/batchinfer-models``. One directory per content hash, so versions never collide."""
    return Path(cache_dir or os.environ.get(MODEL_CACHE_ENV) or Path(tempfile.gettempdir()) / "batchinfer-models")


def fetch_version(
    uri: str,
    sha256: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    verify: bool = True,
) -> tuple[Path, dict[str, Any] | None]:
    """The local directory of the model version at ``uri`` (and, with ``verify``, its re-hashed manifest).

    A local registry is used in place. An object-store one is downloaded into this node's cache
    under the pinned ``sha256``: this runs in every Ray actor, so each node of a multi-node cluster
    fetches the model for itself, once, whichever node the job's driver is on. Concurrent replicas
    on one node each download into a private directory and publish it with one atomic rename; the
    loser of the race discards its copy. A cached copy that fails verification (a disk fault, a
    hand edit) is dropped and downloaded again once; if the fresh copy fails too, the registry
    itself holds a changed model and the error says so.
    """
    import pyarrow.fs as pafs

    source = Stage.open(uri, storage_options)
    if isinstance(source.fs, pafs.LocalFileSystem):
        path = Path(source.path)
        return path, (verify_local_copy(path, sha256) if verify else None)
    cache = model_cache_dir(cache_dir) / sha256
    for fresh in (False, True):
        if fresh or not (cache / MODEL_MANIFEST).exists():
            _download(source, cache, replace=fresh)
        if not verify:
            return cache, None
        try:
            return cache, verify_local_copy(cache, sha256)
        except TamperedModelError as exc:
            if fresh:
                raise TamperedModelError(
                    f"{exc} (downloaded just now from {source.location}: the registry's copy "
                    "changed after it was logged)"
                ) from exc
    raise AssertionError("unreachable")


def _download(source: Stage, cache: Path, replace: bool) -> None:
    import pyarrow.fs as pafs

    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name[:12]}-", dir=cache.parent))
    try:
        with source._io("download"):
            pafs.copy_files(
                source.path, str(tmp), source_filesystem=source.fs, destination_filesystem=pafs.LocalFileSystem()
            )
        if not (tmp / MODEL_MANIFEST).exists():
            raise RegistryError(f"{source.location} holds no {MODEL_MANIFEST}; it is not a logged model version")
        if replace and cache.exists():
            stale = cache.with_name(f".{cache.name[:12]}-stale-{os.getpid()}-{tmp.name}")
            try:
                os.replace(cache, stale)
                shutil.rmtree(stale, ignore_errors=True)
            except FileNotFoundError:
                pass
        try:
            os.replace(tmp, cache)
        except OSError:  # another replica on this node published the same content first
            if not (cache / MODEL_MANIFEST).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def verify_local_copy(path: Path, expected_sha256: str | None = None) -> dict[str, Any]:
    """Re-hash every file of a version and compare with its manifest (and the pinned digest).

    Raises TamperedModelError naming the first file that was changed, added or removed. Runs in the
    operator before launch and on every Ray worker before the model is loaded.
    """
    import json

    manifest_path = path / MODEL_MANIFEST
    if not manifest_path.exists():
        raise RegistryError(f"{path} holds no {MODEL_MANIFEST}; it is not a logged model version")
    manifest = json.loads(manifest_path.read_text())
    recorded = manifest["files"]
    actual = hash_tree(path)
    for rel in sorted(set(recorded) | set(actual)):
        if rel not in actual:
            raise TamperedModelError(
                f"model file {path / rel} was removed after the model was logged; re-log the model"
            )
        if rel not in recorded:
            raise TamperedModelError(f"model file {path / rel} was added after the model was logged; re-log the model")
        if actual[rel]["sha256"] != recorded[rel]["sha256"]:
            raise TamperedModelError(
                f"model file {path / rel} does not match its recorded sha256 (expected {recorded[rel]['sha256'][:12]}…, "
                f"found {actual[rel]['sha256'][:12]}…): it changed after the model was logged; refusing to use it"
            )
    digest = tree_digest(actual)
    if digest != manifest["sha256"] or (expected_sha256 and digest != expected_sha256):
        raise TamperedModelError(
            f"model at {path} has sha256 {digest[:12]}… but {expected_sha256 or manifest['sha256']} was pinned; refusing to use it"
        )
    return manifest


def _stage_pretrained(art: Path, flavor: str, artifact: Any) -> None:
    """Copy a ``save_pretrained`` directory, or save ``(model, tokenizer_or_processor)`` into one.

    A chat model without a chat template is refused here, at log time, rather than on a worker."""
    what = "tokenizer" if flavor == "text_generation" else "image processor"
    if isinstance(artifact, (str, os.PathLike)):
        if not Path(artifact).is_dir():
            raise RegistryError(f"{flavor} artifact {artifact!s} is not a directory (save_pretrained output)")
        shutil.copytree(artifact, art, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".cache"))
    elif (
        isinstance(artifact, (tuple, list))
        and len(artifact) == 2
        and all(hasattr(a, "save_pretrained") for a in artifact)
    ):
        art.mkdir()
        for part in artifact:
            part.save_pretrained(str(art))
    else:
        raise RegistryError(
            f"a {flavor} model needs artifact=<directory written by save_pretrained> or (model, {what}), "
            f"got {type(artifact).__name__}"
        )
    if not (art / "config.json").exists():
        raise RegistryError(f"{flavor} artifact has no config.json; save the model with save_pretrained")
    if flavor == "text_generation":
        config = (
            json.loads((art / "tokenizer_config.json").read_text()) if (art / "tokenizer_config.json").exists() else {}
        )
        if not (art / "chat_template.jinja").exists() and not config.get("chat_template"):
            raise RegistryError(
                "a text_generation model needs a tokenizer with a chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template); set tokenizer.chat_template before saving"
            )


def _python_class_source(python_class: Any, code_paths: list[str] | None) -> tuple[str, str, list[str]]:
    """(module name, class name, files to copy) for a Python-flavor model.

    A class object is located through its source file, which is copied with the model, so the Ray
    workers import exactly the code that was logged. A ``"module:Class"`` string needs
    ``code_paths`` (or a module the workers can already import).
    """
    if isinstance(python_class, str):
        if ":" not in python_class:
            raise RegistryError(f"python_class {python_class!r} must look like 'module:ClassName'")
        module, qualname = python_class.split(":", 1)
        return module, qualname, list(code_paths or [])
    if not inspect.isclass(python_class):
        raise RegistryError(f"python_class must be a class or 'module:ClassName', got {type(python_class).__name__}")
    for method in ("load", "predict"):
        if not callable(getattr(python_class, method, None)):
            raise RegistryError(f"python_class {python_class.__name__} has no {method}() method")
    source = inspect.getsourcefile(python_class)
    if not source:
        raise RegistryError(
            f"cannot find the source file of {python_class.__name__}; pass 'module:Class' and code_paths"
        )
    module = Path(source).stem
    return module, python_class.__qualname__, [source, *(code_paths or [])]
