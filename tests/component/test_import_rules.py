"""The import rules, enforced: the Ray side never loads Airflow, and the Airflow side never imports
the Ray side (launchers start it as ``python -m airflow_provider_batchinfer.runtime``)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_provider_batchinfer"
RUNTIME = PACKAGE / "runtime"
AIRFLOW_SIDE = ("operators", "hooks", "sensors", "triggers", "launchers")


def _runtime_modules() -> list[str]:
    """``airflow_provider_batchinfer.runtime`` and every module below it (flavors included)."""
    names = ["airflow_provider_batchinfer.runtime"]
    for path in sorted(RUNTIME.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return list(dict.fromkeys(names))


def test_the_runtime_and_its_entrypoint_import_no_airflow_module():
    """In a fresh interpreter: import the runtime package, its entrypoint (``__main__``, which runs
    ``main`` only as a script) and every runtime module, then list what got loaded."""
    modules = _runtime_modules()
    assert "airflow_provider_batchinfer.runtime.__main__" in modules
    assert "airflow_provider_batchinfer.runtime.driver" in modules
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.'))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing the runtime loaded Airflow modules: {loaded}"


def _imports(path: Path) -> list[str]:
    """Every module name ``path`` imports (``import x``, ``from x import y``, relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_airflow_side_never_imports_the_runtime():
    offenders = []
    for folder in AIRFLOW_SIDE:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            runtime = sorted(
                {
                    name
                    for name in _imports(path)
                    if name == "airflow_provider_batchinfer.runtime"
                    or name.startswith("airflow_provider_batchinfer.runtime.")
                }
            )
            text = path.read_text()  # and the grep the issue asks for, in case an import hides from the parser
            if (
                runtime
                or "airflow_provider_batchinfer.runtime import" in text
                or "import airflow_provider_batchinfer.runtime" in text
            ):
                offenders.append(f"{path.relative_to(PACKAGE.parent)} imports {', '.join(runtime) or 'the runtime'}")
    assert not offenders, "the Airflow side must start the runtime as `python -m`, not import it:\n" + "\n".join(
        offenders
    )


def test_the_contract_and_the_storage_layer_import_neither_side():
    """The contract, the specs and the storage layer are read by both sides: importing them in a
    fresh interpreter loads neither Airflow nor Ray (nor pyarrow, for the contract alone)."""
    shared = [
        "airflow_provider_batchinfer.contract",
        "airflow_provider_batchinfer.contract.specs",
        "airflow_provider_batchinfer.store.stage",
        "airflow_provider_batchinfer.store.commit.markers",
        "airflow_provider_batchinfer.store.commit.rundir",
        "airflow_provider_batchinfer.store.inputs",
        "airflow_provider_batchinfer.registry",
        "airflow_provider_batchinfer.store.s3",
    ]
    code = (
        "import importlib, json, sys\n"
        "importlib.import_module('airflow_provider_batchinfer.contract')\n"
        "after_contract = sorted(m for m in sys.modules if m.split('.')[0] in ('airflow', 'ray', 'pyarrow'))\n"
        f"for name in {shared!r}:\n"
        "    importlib.import_module(name)\n"
        "after_all = sorted(m for m in sys.modules if m.split('.')[0] in ('airflow', 'ray'))\n"
        "print(json.dumps([after_contract, after_all]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after_contract, after_all = json.loads(proc.stdout.strip().splitlines()[-1])
    assert after_contract == [], f"importing the contract loaded {after_contract}"
    assert after_all == [], f"importing the shared modules loaded {after_all}"


#: what each part of the Airflow side and the storage layer may never import, by the parts' order
#: (face -> triggers -> hooks -> launchers -> storage/registry -> contract/specs): every arrow points
#: down, so no import cycle crosses two parts
FORBIDDEN = {
    "hooks": ("operators", "sensors", "triggers", "lineage", "lineage_tables"),
    "launchers": ("operators", "sensors", "triggers", "hooks", "lineage", "lineage_tables"),
    "triggers": ("operators", "sensors", "lineage", "lineage_tables"),
    "tables": ("operators", "sensors", "triggers", "hooks", "launchers", "specs"),
    "registry": ("operators", "sensors", "triggers", "hooks", "launchers"),
    "contract": ("operators", "sensors", "triggers", "hooks", "launchers", "registry", "tables", "runtime"),
}


def test_each_part_imports_only_the_parts_below_it():
    """TYPE_CHECKING imports count too: a type-only arrow up is still a cycle for a reader."""
    offenders = []
    for part, never in FORBIDDEN.items():
        for path in sorted((PACKAGE / part).rglob("*.py")):
            for name in _imports(path):
                top = name.split(".")[1] if name.startswith("airflow_provider_batchinfer.") else None
                if top in never:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not offenders, "imports that point up the parts' order:\n" + "\n".join(sorted(set(offenders)))
