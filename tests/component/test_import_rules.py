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
AIRFLOW_SIDE = ("operators", "hooks", "sensors", "triggers", "launchers", "ui", "links")


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
    """The contract, the storage layer and the registry are read by both sides: importing every module
    of them in a fresh interpreter loads neither Airflow nor Ray (nor pyarrow, for the contract alone)."""
    shared = [
        name
        for name in _modules()
        if name.split(".")[1:2] in (["contract"], ["store"], ["registry"]) and not name.endswith("demo_models")
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


#: the package's folders from the top down: a module imports only modules of its own folder and of
#: folders ranked below it (the Airflow face -> triggers -> hooks -> launchers -> registry -> store ->
#: contract); the runtime sits on registry, store and contract, and nothing outside it imports it
RANK = {
    "operators": 7,
    "sensors": 7,
    "ui": 7,
    "links": 6,
    "triggers": 6,
    "hooks": 5,
    "launchers": 4,
    "runtime": 4,
    "registry": 3,
    "store": 2,
    "contract": 1,
}
#: the runtime's lifecycle: what starts and runs a job, imported by nothing below the runtime's root
RUNTIME_TOP = ("driver", "reporting", "spare", "__main__")


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    """Which modules of the package each module imports: top-level, function-level and
    ``TYPE_CHECKING`` imports alike (a type-only arrow up is still a circle for a reader).
    ``from package import module`` is an arrow to the module (a package's ``__init__`` runs before
    any of its modules, whoever imports them)."""
    modules = _modules()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    targets.add(full if full in modules else resolve(module))
        graph[name] = {t for t in targets if t.startswith(PACKAGE.name) and t != name}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (its nodes in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _short(name: str) -> str:
    return name.removeprefix(PACKAGE.name + ".")


def test_no_module_imports_itself_through_others():
    circle = _circle(_graph())
    assert circle is None, "an import circle: " + " -> ".join(map(_short, circle or []))


def test_inside_every_folder_the_arrows_point_one_way():
    """Each folder's modules and subfolders, as nodes: no two of them import each other, however
    indirectly (so the runtime's root, ``plan``, ``engine``, ``rows``... form no loop either)."""
    graph = _graph()
    offenders = []
    for folder in sorted(name for name, path in _modules().items() if path.name == "__init__.py"):

        def child(module: str, folder: str = folder) -> str | None:
            if not module.startswith(folder + "."):
                return None
            return folder + "." + module[len(folder) + 1 :].split(".")[0]

        children: dict[str, set[str]] = {}
        for module, targets in graph.items():
            if (here := child(module)) is not None:
                children.setdefault(here, set()).update(
                    there for t in targets if (there := child(t)) is not None and there != here
                )
        if circle := _circle(children):
            offenders.append(" -> ".join(map(_short, circle)))
    assert not offenders, "folders whose parts import each other:\n" + "\n".join(offenders)


def test_each_folder_imports_only_the_folders_below_it():
    offenders = []
    for module, targets in _graph().items():
        parts = module.split(".")
        if len(parts) < 3 and not (PACKAGE / parts[-1]).is_dir():
            continue  # a root module (the package's face, the provider info, the old paths) is the top
        folder = parts[1]
        for target in targets:
            there = target.split(".")
            if len(there) < 2 or there[1] == folder:
                continue
            if there[1] == "runtime" or RANK.get(there[1], 99) >= RANK[folder]:
                offenders.append(f"{_short(module)} imports {_short(target)}")
    assert not offenders, "imports that point up the folders' order (or into the runtime):\n" + "\n".join(
        sorted(offenders)
    )


def test_every_folder_is_ranked_and_the_root_holds_only_the_face():
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(RANK), "a folder without a place in RANK (or a place without a folder)"
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "_moved.py", "get_provider_info.py"], loose


def test_hooks_never_import_operators_and_nothing_below_the_runtime_root_imports_its_lifecycle():
    offenders = []
    for module, targets in _graph().items():
        for target in targets:
            if module.startswith(f"{PACKAGE.name}.hooks") and target.startswith(f"{PACKAGE.name}.operators"):
                offenders.append(f"{_short(module)} imports {_short(target)}")
            below_root = module.startswith(f"{PACKAGE.name}.runtime.") and module.count(".") >= 3
            if below_root and target.rpartition(".")[2] in RUNTIME_TOP and target.count(".") == 2:
                offenders.append(f"{_short(module)} imports {_short(target)}")
    assert not offenders, "\n".join(sorted(offenders))
