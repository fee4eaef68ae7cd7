"""The embedded Ray's head process: Ray's own ``Node``, started as ``ray start --head --block`` does.

The ``ray`` command imports every CLI of Ray before it starts anything: Serve's too, with pandas and
FastAPI behind it, about 1.2 CPU-seconds that sit first on a cold job's path on two cores. This
module imports only Ray's node and parameters, then does what ``ray start --head --block`` does
with them: it starts the node, prints Ray's own "Ray runtime started." line, watches the node's
processes and stops them all when one dies or when it is sent SIGTERM. State files, log files, the
GCS address and token auth are Ray's own, so ``ray status`` and ``ray.init(address=...)`` see the
same head either way.

It also leaves out the head processes a job on this machine never uses; on two cores each start
is CPU a cold job waits for:

- the Ray Client server: the runtime attaches to the GCS address directly, never through
  ``ray://``;
- the autoscaler's monitor: a single machine that never adds a node has nothing to scale;
- the API server (``dashboard.py``, started even without the dashboard): it serves the Jobs and
  State APIs, which the local launcher never calls (it starts the runtime as a process of its own
  and reads its log), and Ray waits for it to come up. ``ray status`` reads the GCS and still
  works; ``ray list`` and ``ray job`` have nothing to ask.

An operator's own ``RAY_START_HOOK`` is still called, as ``ray start`` calls it, after these choices.

Imports neither Airflow nor the rest of the provider: it is the head's whole program.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

#: ``ray start`` calls the function this names with the head's parameters before starting anything
START_HOOK_ENV = "RAY_START_HOOK"
#: the line Ray prints once its head is up (``ray start`` prints the same)
READY_LINE = "Ray runtime started."
#: the ports a head listens on besides the GCS's, each a ``--<name>-port`` option of this program
#: and of ``ray start``; ``RayParams`` names them differently
PORTS = {
    "dashboard-agent-listen": "dashboard_agent_listen_port",
    "dashboard-agent-grpc": "metrics_agent_port",
    "metrics-export": "metrics_export_port",
    "runtime-env-agent": "runtime_env_agent_port",
    "node-manager": "node_manager_port",
    "object-manager": "object_manager_port",
}


def head_params(port: int, temp_dir: str, ports: dict[str, int]) -> Any:
    """The head's ``RayParams``: what ``ray start --head --include-dashboard=false`` builds, on
    127.0.0.1, with no Ray Client server and no autoscaler's monitor."""
    from ray._private.parameter import RayParams

    params = RayParams(
        node_ip_address="127.0.0.1",
        node_name="127.0.0.1",
        temp_dir=temp_dir,
        include_dashboard=False,
        ray_client_server_port=None,
        no_monitor=True,
        **{PORTS[name]: value for name, value in ports.items()},
    )
    params.gcs_server_port = port
    params.update_if_absent(redis_shard_ports=None, num_redis_shards=None, redis_max_clients=None)
    return params


def skip_api_server() -> None:
    """Make this process's Ray node start no API server. Only a method of that name is replaced: a
    Ray that renamed it starts its API server as before, which costs time and breaks nothing."""
    from ray._private import node

    if callable(getattr(node.Node, "start_api_server", None)):
        node.Node.start_api_server = _no_api_server


def _no_api_server(self: Any, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
    """Ray's ``Node.start_api_server``, starting nothing: the node then records no dashboard URL."""


def call_operator_hook(params: Any, environ: Mapping[str, str] = os.environ) -> None:
    """Call the function ``RAY_START_HOOK`` names, if any, with the head's parameters, as ``ray
    start`` would: an operator's own changes win over this module's."""
    hook = environ.get(START_HOOK_ENV)
    if hook:
        from ray._common.utils import load_class

        load_class(hook)(params, True)


def find_registration_sooner(poll_s: float = 0.02, wait_s: float = 30.0) -> None:
    """Make this process's Ray node see its raylet register within ``poll_s`` of it happening.

    The node waits for its raylet through Ray's ``services.get_node``, whose native call looks for
    the node once a second: a raylet that registers just after a look costs a whole second more, on
    every cold job's path. Asking the GCS for its nodes is cheap, so this asks every ``poll_s``
    first; Ray's own call then finds the node at once, and still reports what it reports when the
    raylet never registers."""
    from ray._private import services
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    ray_get_node = services.get_node

    def get_node(gcs_address: str, node_id: str) -> Any:
        client = GcsClient(address=gcs_address)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _registered(client, node_id) is False:
            time.sleep(poll_s)
        return ray_get_node(gcs_address, node_id)

    services.get_node = get_node


def _registered(client: Any, node_id: str) -> bool | None:
    """Whether the GCS lists the node; None when it cannot be asked (a Ray whose client differs):
    Ray's own lookup then decides, at its own pace, and the head starts as it always did."""
    try:
        return any(node.hex() == node_id for node in client.get_all_node_info(timeout=1.0))
    except Exception:
        return None


def start_head(params: Any) -> Any:
    """Ray's head node, started with ``params``: token auth checked first, as ``ray start`` does
    (``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN_PATH`` come from the environment)."""
    from ray._private import node
    from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled

    call_operator_hook(params)
    skip_api_server()
    find_registration_sooner()
    ensure_token_if_auth_enabled(params._system_config, create_token_if_missing=False)
    return node.Node(params, head=True, shutdown_at_exit=True, spawn_reaper=True)


def watch(head: Any, poll_s: float = 1.0) -> int:
    """Wait while every process of the node runs; when one ends, stop the rest and return 1. Unlike
    ``ray start --block``, which goes on when one ends as SIGTERM ends it, any end stops the node: a
    node without its GCS, raylet or log monitor serves no job, and the next job that finds it stale
    starts a new one. A SIGTERM to this process stops them all through the handler Ray's ``Node``
    installed."""
    while True:
        time.sleep(poll_s)
        dead = head.dead_processes()
        if dead:
            ended = [(kind, proc.returncode) for kind, proc in dead]
            print(f"Ray processes ended: {ended}; stopping the rest", flush=True)
            head.kill_all_processes(check_alive=False, allow_graceful=False)
            return 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_provider_batchinfer.launchers.embedded.ray_head")
    parser.add_argument("--port", type=int, required=True, help="the GCS port")
    parser.add_argument("--temp-dir", required=True)
    for name in PORTS:
        parser.add_argument(f"--{name}-port", type=int, required=True)
    args = parser.parse_args(argv)
    ports = {name: getattr(args, f"{name.replace('-', '_')}_port") for name in PORTS}
    head = start_head(head_params(args.port, args.temp_dir, ports))
    print(f"{READY_LINE} GCS at {head.address}", flush=True)
    return watch(head)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
