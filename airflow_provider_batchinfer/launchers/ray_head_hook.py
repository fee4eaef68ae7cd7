"""What the embedded Ray's ``ray start --head`` leaves out: run inside that command (``RAY_START_HOOK``).

``ray start`` calls the function named by ``RAY_START_HOOK`` with its parameters before it starts
anything. The embedded Ray (``embedded_ray.py``) names :func:`trim_head`, which drops the two head
processes a job on this machine never uses; on two cores each start is CPU a cold job waits for:

- the Ray Client server: the runtime attaches to the GCS address directly, never through
  ``ray://``, and ``ray start`` has no flag to leave the server out while Ray Client's
  dependencies are installed (its port must be 1024 or more);
- the autoscaler's monitor: a single machine that never adds a node has nothing to scale;
- the API server (``dashboard.py``, started even with ``--include-dashboard=false``): it serves
  the Jobs and State APIs, which the local launcher never calls (it starts the runtime as a
  process of its own and reads its log). ``ray start`` waits for it to come up, about a second of
  a cold job's start on two cores, and has no flag to leave it out. ``ray status`` reads the GCS
  and still works; ``ray list`` and ``ray job`` have nothing to ask.

Imports nothing of its own: it runs in the ``ray start`` process, which imports Ray itself.
"""

from __future__ import annotations

from typing import Any

#: what ``RAY_START_HOOK`` names for the embedded Ray's head
HOOK = f"{__name__}.trim_head"


def trim_head(ray_params: Any, head: bool) -> None:
    """Start the head without the Ray Client server, the autoscaler's monitor and the API server."""
    if head:
        ray_params.ray_client_server_port = None
        ray_params.no_monitor = True
        skip_api_server()


def skip_api_server() -> None:
    """Make this process's Ray node start no API server. Only a method of that name is replaced: a
    Ray that renamed it starts its API server as before, which costs time and breaks nothing."""
    from ray._private import node

    if callable(getattr(node.Node, "start_api_server", None)):
        node.Node.start_api_server = _no_api_server


def _no_api_server(self: Any, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
    """Ray's ``Node.start_api_server``, starting nothing: the node then records no dashboard URL."""
