"""Old import paths of the modules that moved into concept folders, kept for one release.

Each old path names the same module object as its new one, so a DAG file or a plugin that imports
an old path keeps working (``isinstance`` and patching included) and is told, once per import, with
a ``DeprecationWarning`` where to import from instead. Nothing is copied or wrapped: the finder
below only answers for the names in :data:`MOVED`, after the real module has been imported under
its own name. ``airflow_provider_batchinfer/__init__.py`` installs it; it imports nothing else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import FrameType, ModuleType

_PACKAGE = "airflow_provider_batchinfer"

# old path -> new path, both under the package
MOVED: dict[str, str] = {
    "chat": "contract.chat",
    "contract.private_dir": "store.private_dir",
    "delivery": "store.delivery",
    "demo_models": "registry.demo_models",
    "fence": "store.commit.fence",
    "fence_local": "store.commit.fence_local",
    "identity": "store.identity",
    "inputs": "store.inputs",
    "job_session": "launchers.job_session",
    "launchers.embedded_ray": "launchers.embedded.embedded_ray",
    "launchers.procs": "launchers.embedded.procs",
    "launchers.ray_head": "launchers.embedded.ray_head",
    "launchers.state_dirs": "launchers.embedded.state_dirs",
    "launchers.warm_runtime": "launchers.embedded.warm_runtime",
    "lineage": "operators.lineage",
    "lineage_tables": "operators.lineage_tables",
    "markers": "store.commit.markers",
    "operators.job_file": "operators.build_job",
    "part_bytes": "store.commit.part_bytes",
    "redact": "store.redact",
    "roots": "store.roots",
    "rundir": "store.commit.rundir",
    "rundir_resume": "store.commit.rundir_resume",
    "runtime.commit": "runtime.output.commit",
    "runtime.dereference": "runtime.model.dereference",
    "runtime.done_set": "runtime.rows.done_set",
    "runtime.empty_input": "runtime.engine.empty_input",
    "runtime.flavors": "runtime.model.flavors",
    "runtime.flavors.image_classification": "runtime.model.flavors.image_classification",
    "runtime.flavors.lightgbm_booster": "runtime.model.flavors.tabular.lightgbm_booster",
    "runtime.flavors.mlflow_pyfunc": "runtime.model.flavors.mlflow_pyfunc",
    "runtime.flavors.onnx_model": "runtime.model.flavors.tabular.onnx_model",
    "runtime.flavors.optimized_cache": "runtime.model.flavors.optimized.optimized_cache",
    "runtime.flavors.optimized_text": "runtime.model.flavors.optimized.optimized_text",
    "runtime.flavors.optimized_torchscript": "runtime.model.flavors.optimized.optimized_torchscript",
    "runtime.flavors.protocol": "runtime.model.flavors.protocol",
    "runtime.flavors.python_class": "runtime.model.flavors.python_class",
    "runtime.flavors.scikit_learn": "runtime.model.flavors.tabular.scikit_learn",
    "runtime.flavors.sentence_gpu": "runtime.model.flavors.sentence_gpu",
    "runtime.flavors.sentence_transformers": "runtime.model.flavors.sentence_transformers",
    "runtime.flavors.tabular_inputs": "runtime.model.flavors.tabular.tabular_inputs",
    "runtime.flavors.text_generation": "runtime.model.flavors.text_generation",
    "runtime.flavors.torchscript": "runtime.model.flavors.torchscript",
    "runtime.flavors.transformers_pipeline": "runtime.model.flavors.transformers_pipeline",
    "runtime.flavors.xgboost_booster": "runtime.model.flavors.tabular.xgboost_booster",
    "runtime.id_hash": "runtime.rows.id_hash",
    "runtime.in_driver": "runtime.engine.in_driver",
    "runtime.in_driver_io": "runtime.engine.in_driver_io",
    "runtime.io": "runtime.output.parts",
    "runtime.llm": "runtime.model.llm",
    "runtime.local_open": "runtime.model.local_open",
    "runtime.ort": "runtime.model.ort",
    "runtime.parquet_read": "runtime.inputs.parquet_read",
    "runtime.part_rows": "runtime.engine.part_rows",
    "runtime.plan": "runtime.planning.pipeline",
    "runtime.pool_dataset": "runtime.engine.pool_dataset",
    "runtime.progress": "runtime.engine.progress",
    "runtime.replica": "runtime.model.replica",
    "runtime.resource_plan": "runtime.planning.resource_plan",
    "runtime.resources": "runtime.planning.resources",
    "runtime.resume": "runtime.rows.resume",
    "runtime.reuse": "runtime.incremental.scoring",
    "runtime.reuse_keys": "runtime.incremental.keys",
    "runtime.reuse_match": "runtime.incremental.match",
    "runtime.reuse_source": "runtime.incremental.source",
    "runtime.small_input": "runtime.inputs.small_input",
    "runtime.sql_input": "runtime.inputs.sql_input",
    "runtime.table_commit": "runtime.output.table_commit",
    "runtime.table_fence": "runtime.output.table_fence",
    "runtime.table_input": "runtime.inputs.table_input",
    "runtime.unique_ids": "runtime.rows.unique_ids",
    "runtime.url_fetch": "runtime.model.url_fetch",
    "runtime.usage": "runtime.model.usage",
    "runtime.usage_board": "runtime.model.usage_board",
    "s3": "store.s3",
    "s3_objects": "store.s3_objects",
    "specs": "contract.specs",
    "specs.common": "contract.specs.common",
    "specs.io": "contract.specs.io",
    "specs.job": "contract.specs.job",
    "stage": "store.stage",
    "tables": "store.iceberg",
    "tables.catalog": "store.iceberg.catalog",
    "tables.names": "contract.specs.tables",
    "tables.read": "store.iceberg.read",
    "verdicts": "store.commit.verdicts",
}
# (the rows above: every module the move into concept folders renamed)
# modules folded into another one later: the old path is the module that now holds their names
MOVED.update(
    {
        "operators.lineage_methods": "operators.lineage",
        "operators.sql_input": "operators.build_job",
        "registry.private_dir": "registry.fetch",
    }
)

_CONTRACT_NAMES = ("ERRORS_DIR", "INPUT_DIR", "JOB_SPEC_FILE", "MANIFEST_FORMAT", "SUCCESS_MARKER", "ManifestError")
_LOCATION_NAMES = ("StageError", "sanitize_run_key", "check_relative_path", "is_uri", "resolve_location", "join")
_MARKER_NAMES = ("as_manifest", "committed_files", "dead_letter_files", "file_sha256", "validate_manifest")

# old path -> {name: the module it lives in now}, for names that left their module when it moved
# (an old path with a row here is a module of its own that forwards to the new ones)
MOVED_NAMES: dict[str, dict[str, str]] = {
    "stage": {
        **dict.fromkeys(_CONTRACT_NAMES, "contract"),
        **dict.fromkeys(("attempt_of", "is_part_name", "new_attempt_id", "part_name"), "contract"),
        **dict.fromkeys(_LOCATION_NAMES, "store.locations"),
        **dict.fromkeys(_MARKER_NAMES, "store.commit.markers"),
        **dict.fromkeys(("read_committed", "read_valid_manifest"), "store.committed"),
    },
    "markers": dict.fromkeys(("read_committed", "read_valid_manifest"), "store.committed"),
    "verdicts": {"normalized_location": "store.locations"},
    "fence": {"claims_for": "store.commit.claims"},
    "tables": dict.fromkeys(
        ("iceberg_input", "is_run_location", "is_table_input", "run_location"), "contract.specs.tables"
    ),
}


def _caller_level() -> int:
    """The ``stacklevel`` that points the warning at the import statement, past the import machinery
    (``warnings`` itself steps over the frozen ``importlib._bootstrap`` frames without counting them)."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(("importlib", __name__)):
        frame = frame.f_back
        if frame is not None and not (
            "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename
        ):
            level += 1
    return level


class _Forwarding(ModuleType):
    """An old path whose module lost some names to other modules: the new module's names, and each
    moved name from where it lives now, with a warning naming that place."""

    def __init__(self, name: str, module: ModuleType, names: dict[str, str]) -> None:
        super().__init__(name, module.__doc__)
        self._module = module
        self._names = names

    def __getattr__(self, attr: str) -> object:
        new = self._names.get(attr)
        if new is None:
            return getattr(self._module, attr)
        warnings.warn(
            f"{self.__name__}.{attr} moved to {_PACKAGE}.{new}; import it from there (the old path goes in the next "
            "release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(f"{_PACKAGE}.{new}"), attr)


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module already imported under its new one (or its forwarding module)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        # the import system has just set the old name's spec on the module: a real one keeps its own
        if not isinstance(module, _Forwarding):
            module.__spec__ = self.spec


class MovedModules(importlib.abc.MetaPathFinder):
    """Answers an old module path with its new module and a DeprecationWarning; None for any other."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname[len(_PACKAGE) + 1 :]) if fullname.startswith(_PACKAGE + ".") else None
        if new is None:
            return None
        module = importlib.import_module(f"{_PACKAGE}.{new}")
        warnings.warn(
            f"{fullname} moved to {module.__name__}; import it from there (the old path goes in the next release)",
            DeprecationWarning,
            stacklevel=_caller_level(),
        )
        names = MOVED_NAMES.get(fullname[len(_PACKAGE) + 1 :])
        loaded = module if names is None else _Forwarding(fullname, module, names)
        return importlib.machinery.ModuleSpec(fullname, _Alias(loaded), is_package=hasattr(module, "__path__"))


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once: first, so that a folder an old checkout left
    behind (a stray ``__pycache__``) is not taken for an empty namespace package."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
