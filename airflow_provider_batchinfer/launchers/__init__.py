"""Ways to run the runtime entrypoint, one module each, behind :class:`launchers.base.Launcher`.

The registry maps a connection's ``launcher`` value to its class, imported lazily (a DAG file that
never launches imports none). A third launcher (a per-job cluster, a managed Ray) is one new module
and one line here. Imports neither Airflow nor Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow_provider_batchinfer.launchers.base import Launcher

#: connection ``launcher`` value -> "module:Class"
LAUNCHERS: dict[str, str] = {
    "local": "airflow_provider_batchinfer.launchers.local:LocalLauncher",
    "ray_jobs": "airflow_provider_batchinfer.launchers.ray_jobs:RayJobsLauncher",
}
LAUNCHER_NAMES: tuple[str, ...] = tuple(LAUNCHERS)
DEFAULT_LAUNCHER = "local"


def launcher_class(name: str) -> type[Launcher]:
    """The class registered under ``name``; a ValueError names the available ones."""
    if name not in LAUNCHERS:
        raise ValueError(f"launcher {name!r} is not available; use one of {LAUNCHER_NAMES}")
    module, _, cls = LAUNCHERS[name].partition(":")
    launcher: type[Launcher] = getattr(importlib.import_module(module), cls)
    return launcher
