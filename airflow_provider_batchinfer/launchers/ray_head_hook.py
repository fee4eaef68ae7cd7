"""What the embedded Ray's ``ray start --head`` leaves out: run inside that command (``RAY_START_HOOK``).

``ray start`` calls the function named by ``RAY_START_HOOK`` with its parameters before it starts
anything. The embedded Ray (``embedded_ray.py``) names :func:`trim_head`, which drops the two head
processes a job on this machine never uses; on two cores each start is CPU a cold job waits for:

- the Ray Client server: the runtime attaches to the GCS address directly, never through
  ``ray://``, and ``ray start`` has no flag to leave the server out while Ray Client's
  dependencies are installed (its port must be 1024 or more);
- the autoscaler's monitor: a single machine that never adds a node has nothing to scale.

Imports nothing: it runs in the ``ray start`` process, which imports Ray itself.
"""

from __future__ import annotations

from typing import Any

#: what ``RAY_START_HOOK`` names for the embedded Ray's head
HOOK = f"{__name__}.trim_head"


def trim_head(ray_params: Any, head: bool) -> None:
    """Start the head without the Ray Client server and the autoscaler's monitor."""
    if head:
        ray_params.ray_client_server_port = None
        ray_params.no_monitor = True
